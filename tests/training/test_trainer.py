"""The trainer's honest account: counters, run.json, metrics.jsonl, time split, eval, resume, refusals.

Every run here is the tiny-unit model on the built-in corpus (prepared once per session), pinned to one
intra-op thread so that repeated runs are bit-identical.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from pilotrun.commands.cli import main
from pilotrun.common.errors import CheckpointError, ConfigError
from pilotrun.config import config_to_dict, load_run_config
from pilotrun.data.reader import open_dataset
from pilotrun.optim.schedule import lr_multiplier
from pilotrun.run.record import read_metrics_strict, read_run_json
from pilotrun.training.callbacks.evaluation import evaluate
from pilotrun.training.trainer import Trainer, describe_plan

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke.yaml"
REQUIRED = ("event", "time", "session_id", "step", "tokens_seen", "updates_attempted", "updates_skipped")


def smoke_config(*overrides: str):
    return load_run_config(SMOKE, ["train.num_threads=1", *overrides])


def train(config, data_dir, run_dir, **kwargs):
    trainer = Trainer(config, data_dir, run_dir, progress=False, **kwargs)
    return trainer, trainer.run()


def strict_lines(run_dir: Path) -> list[dict]:
    """Every line of metrics.jsonl as strict JSON (a bare NaN/Infinity constant fails the test)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
        for line in lines
    ]


@pytest.mark.slow
def test_smoke_run_record_is_complete_and_true(builtin_data_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    config = smoke_config()
    trainer, result = train(config, builtin_data_dir, run_dir, command=["pilotrun", "train", "test"])
    out = capsys.readouterr().out
    assert (
        "tokens_per_update = batch_size * seq_len * gradient_accumulation_steps * world_size = 4 * 32 * 1 * "
        "1 = 128"
        in out
    )
    assert "planned tokens = max_steps * tokens_per_update = 6 * 128 = 768" in out
    assert (result.reason, result.exit_code, result.step, result.tokens_seen) == ("completed", 0, 6, 768)

    run = read_run_json(run_dir)
    dataset = open_dataset(builtin_data_dir)
    assert run["tokens_per_update"] == 128
    assert run["recipe"] == config_to_dict(trainer.config)
    # 0 in the recipe: resolved from the data
    assert run["recipe"]["model"]["vocab_size"] == dataset.vocab_size
    assert (
        run["data"]["train"]["metadata_sha256"]
        == run["data"]["val"]["metadata_sha256"]
        == dataset.metadata_sha256
    )
    assert run["data"]["train"]["tokens"] == dataset.split("train").num_tokens
    assert run["data"]["val"]["documents"] == dataset.split("val").documents
    model_params = sum(p.numel() for p in trainer.session.raw_model.parameters())
    assert run["model"]["parameters"] == model_params
    assert 0 < run["model"]["active_parameters"] < model_params and run["model"]["flops_per_token"] > 0
    groups = run["optimizer"]["groups"]
    assert sum(g["count"] for g in groups) == model_params
    assert {g["optimizer"] for g in groups} == {"muon", "adamw"}
    (session,) = run["sessions"]
    assert (
        session["start_step"] == 0 and session["start_tokens_seen"] == 0 and session["resumed_from"] is None
    )
    assert session["command"] == ["pilotrun", "train", "test"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    # the recorded commit is this checkout's HEAD or (others commit meanwhile) an ancestor
    if head.returncode == 0:
        ancestor = subprocess.run(
            ["git", "-C", str(ROOT), "merge-base", "--is-ancestor", session["git"]["commit"], "HEAD"],
            capture_output=True,
        )
        assert ancestor.returncode == 0
        assert isinstance(session["git"]["dirty"], bool) and len(session["git"]["diff_sha256"]) == 64
    assert session["hardware"]["world_size"] == 1 and session["hardware"]["device"] == "cpu"
    assert session["software"]["torch"] == torch.__version__

    events = strict_lines(run_dir)
    for event in events:
        assert all(key in event for key in REQUIRED), event
        assert event["session_id"] == session["session_id"]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "session_start" and kinds[-1] == "session_end"
    assert kinds.count("train") == 6  # log_every 1: one per update
    assert kinds.count("val") == 2 and kinds.count("checkpoint") == 2  # steps 3 and 6
    trains = [e for e in events if e["event"] == "train"]
    for number, event in enumerate(trains, start=1):
        window = event["window"]
        assert event["step"] == number and event["tokens_seen"] == 128 * number
        assert window["updates_applied"] == window["updates_attempted"] == 1 and window["tokens"] == 128
        assert window["microbatches"] == 1 and 0 < window["train_seconds"] <= window["wall_seconds"]
        assert isinstance(event["loss"], float) and math.isfinite(event["loss"])
        assert event["lr"] == pytest.approx(3e-3 * lr_multiplier(number - 1, trainer.config.optim.schedule))
        assert event["throughput"]["mfu"] == "unknown" and event["throughput"]["achieved_flops_per_s"] > 0
        assert len(event["moe"]["tokens_per_expert"]) == 1  # one MoE layer
        assert sum(event["moe"]["tokens_per_expert"][0]) == 128 * 2  # every token routed to top_k = 2 experts
        assert len(event["qk_clip"]["max_logit"]) == 2 and event["memory"]["peak_rss_mb"] > 0
    end = events[-1]
    assert end["reason"] == "completed" and end["step"] == 6
    split = end["time_split"]
    parts = (
        split["train_seconds"]
        + split["eval_seconds"]
        + split["checkpoint_seconds"]
        + split["profile_seconds"]
        + split["report_seconds"]
        + split["other_seconds"]
    )
    assert parts == pytest.approx(split["wall_seconds"], rel=1e-9)
    # nothing profiled; events were written
    assert split["profile_seconds"] == 0.0 and split["report_seconds"] > 0
    assert all(e["window"]["profiled_attempts"] == 0 for e in trains)
    assert split["train_seconds"] == pytest.approx(
        sum(e["window"]["train_seconds"] for e in trains), rel=1e-9
    )
    checkpoint = [e for e in events if e["event"] == "checkpoint"][-1]
    assert checkpoint["step"] == 6 and Path(checkpoint["path"]).is_dir() and checkpoint["bytes"] > 0


@pytest.mark.slow
def test_fp16_overflow_skips_count_apart_from_applied_updates(builtin_data_dir, tmp_path):
    # A loss scale of 2**24 overflows fp16 gradients until the scaler has backed off far enough: real skips.
    config = smoke_config("train.precision=fp16", "train.loss_scale_init=16777216", "train.max_steps=4",
                          "train.gradient_accumulation_steps=2", "train.log_every=2", "train.eval_every=0")
    trainer, result = train(config, builtin_data_dir, tmp_path / "run")
    events = strict_lines(tmp_path / "run")
    overflows = [e for e in events if e["event"] == "overflow"]
    assert result.step == 4 and result.updates_skipped == len(overflows) >= 1
    assert result.updates_attempted == result.step + result.updates_skipped
    # every microbatch counts, applied or not
    assert result.tokens_seen == result.updates_attempted * 2 * 4 * 32
    for index, event in enumerate(overflows, start=1):
        assert event["reason"] == "overflow" and event["updates_skipped"] == index
        assert event["loss_scale_after"] == event["loss_scale_before"] / 2
    assert all(e["step"] == 0 for e in overflows)  # the skips came first, and none of them moved `step`
    trains = [e for e in events if e["event"] == "train"]
    assert sum(e["window"]["updates_skipped"] for e in trains) == len(overflows)
    assert sum(e["window"]["updates_applied"] for e in trains) == 4
    assert sum(e["window"]["tokens"] for e in trains) == result.tokens_seen
    # The schedule followed applied updates only: the first window's LR is that of step 1, not of attempt k.
    assert trains[0]["lr"] == pytest.approx(3e-3 * lr_multiplier(1, config.optim.schedule))
    assert trains[0]["loss_scale"] < 16777216


@pytest.mark.slow
def test_exhausted_training_split_restarts_and_is_logged(tmp_path):
    from pilotrun.data.prepare import prepare_corpus

    corpus = tmp_path / "tiny.txt"
    corpus.write_text(
        "\n\n".join(f"Document number {i} says something short about item {i * 7}." for i in range(60))
    )
    data_dir = tmp_path / "data"
    prepare_corpus(data_dir, source=str(corpus), tokenizer="bpe:300", val_fraction=0.3, progress=False)
    train_tokens = open_dataset(data_dir).split("train").num_tokens
    batches_per_epoch = ((train_tokens - 1) // 32) // 4
    steps = batches_per_epoch + 2
    config = smoke_config(f"train.max_steps={steps}", "train.eval_every=0", "train.checkpoint_every=0")
    out = io.StringIO()
    _, result = train(config, data_dir, tmp_path / "run", out=out)
    events = strict_lines(tmp_path / "run")
    restarts = [e for e in events if e["event"] == "data_restart"]
    assert len(restarts) == 1 and restarts[0]["epoch"] == 1 and restarts[0]["data_restarts"] == 1
    # said in the log when it happens, at the event's step and tokens
    said = [line for line in out.getvalue().splitlines() if line.startswith("data: ")]
    assert said == [f"data: the training split's pass 2 begins at step {restarts[0]['step']:,} (tokens_seen "
                    f"{restarts[0]['tokens_seen']:,}); the training loss from here is partly on tokens "
                    "already trained on"]
    # and marked on the plots at that step, read back from the record
    from pilotrun.report.drawing.marks import Mark, run_marks
    from pilotrun.report.record_check.summarize import summarize_run

    assert run_marks(summarize_run(tmp_path / "run")) == [Mark("pass", restarts[0]["step"], "pass 2")]
    assert restarts[0]["updates_attempted"] == batches_per_epoch + 1  # the first batch of the second pass
    trains = [e for e in events if e["event"] == "train"]
    assert trains[-1]["data_restarts"] == 1 and trains[-1]["epoch"] == 1
    assert trains[batches_per_epoch - 1]["data_restarts"] == 0 and result.step == steps


@pytest.mark.slow
def test_interrupted_and_resumed_run_repeats_the_same_losses(builtin_data_dir, tmp_path):
    config = smoke_config("train.max_steps=8", "train.eval_every=4")
    train(config, builtin_data_dir, tmp_path / "straight")
    train(smoke_config("train.max_steps=5", "train.eval_every=4"), builtin_data_dir, tmp_path / "split")
    with pytest.raises(ConfigError, match="already exists: pass --resume"):
        Trainer(config, builtin_data_dir, tmp_path / "split", progress=False)
    trainer, result = train(config, builtin_data_dir, tmp_path / "split", resume=True, from_step=3)
    assert trainer.session.resumed_from == 3 and result.step == 8

    def losses(run_dir, event):
        return {e["step"]: e["loss"] for e in read_metrics_strict(run_dir) if e["event"] == event}

    straight, split = losses(tmp_path / "straight", "train"), losses(tmp_path / "split", "train")
    assert straight == split and len(straight) == 8  # exact float equality, step by step
    assert losses(tmp_path / "straight", "val") == losses(tmp_path / "split", "val")
    run = read_run_json(tmp_path / "split")
    assert [s["resumed_from"] for s in run["sessions"]] == [None, 3]
    assert run["sessions"][1]["start_step"] == 3 and run["sessions"][1]["start_tokens_seen"] == 384
    start = [e for e in read_metrics_strict(tmp_path / "split") if e["event"] == "session_start"][1]
    assert (start["step"], start["tokens_seen"], start["resumed_from"]) == (3, 384, 3)
    a = torch.load(tmp_path / "straight" / "checkpoints" / "step-00000008" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "split" / "checkpoints" / "step-00000008" / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_resume_records_the_restored_recipe_and_allowed_changes(builtin_data_dir, tmp_path):
    train(smoke_config("train.max_steps=3"), builtin_data_dir, tmp_path / "run")
    with pytest.raises(CheckpointError, match="optim.muon.lr"):
        Trainer(smoke_config("train.max_steps=5", "optim.muon.lr=0.01"), builtin_data_dir, tmp_path / "run",
                resume=True, progress=False)
    trainer, result = train(smoke_config("train.max_steps=5", "optim.muon.lr=0.01"), builtin_data_dir,
                            tmp_path / "run", resume=True, allow_changes=["optim.muon.lr"])
    run = read_run_json(tmp_path / "run")
    assert run["recipe"]["optim"]["muon"]["lr"] == 0.01 and run["recipe"]["train"]["max_steps"] == 5
    (change,) = run["allowed_changes"]
    assert change["key"] == "optim.muon.lr" and change["old"] == 3e-3 and change["new"] == 0.01
    assert change["session_id"] == run["sessions"][1]["session_id"] and result.step == 5


def test_resume_needs_a_record_and_a_checkpoint(builtin_data_dir, tmp_path):
    with pytest.raises(CheckpointError, match="nothing to resume"):
        Trainer(smoke_config(), builtin_data_dir, tmp_path / "missing", resume=True, progress=False)
    with pytest.raises(ConfigError, match="--from-step needs --resume"):
        Trainer(smoke_config(), builtin_data_dir, tmp_path / "new", from_step=3, progress=False)
    assert not (tmp_path / "new").exists()  # refused before anything was written


@pytest.mark.slow
def test_evaluation_moves_no_counter_or_tracker(builtin_data_dir, tmp_path):
    from pilotrun.model.diagnostics import collect_step_statistics

    trainer = Trainer(smoke_config(), builtin_data_dir, tmp_path / "run", progress=False)
    before = [t.clone() for t in collect_step_statistics(trainer.session.raw_model)]
    state = trainer.session.state.state_dict()
    first = evaluate(trainer.session, trainer.config.train.eval)
    second = evaluate(trainer.session, trainer.config.train.eval)
    after = collect_step_statistics(trainer.session.raw_model)
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert trainer.session.state.state_dict() == state and trainer.session.raw_model.training
    assert first["loss"] == second["loss"]  # the same batches from the start of val, every time
    assert first["batches"] == 2 and first["tokens"] == 2 * 128
    trainer.session.metrics.close()


def test_plan_lines_count_world_size():
    config = smoke_config("train.gradient_accumulation_steps=3", "train.max_steps=10")
    lines = describe_plan(config, world_size=8, start_step=4)
    assert lines[0].endswith("4 * 32 * 3 * 8 = 3,072")
    assert lines[1].endswith("10 * 3,072 = 30,720")
    assert "6 updates (18,432 tokens) remain" in lines[2]
    assert lines[3].startswith("compile: none (eager)")
    assert "repays the compile after tens to hundreds" in lines[3]


@pytest.mark.parametrize("mode, device_type, fragment", [
    ("none", "cpu", "repays the compile after tens to hundreds of updates"),
    ("none", "cuda", "long enough to repay"),
    ("inductor", "cpu", "gains a few percent per update"),
    ("inductor", "cuda", "the first update is slower"),
    ("eager", "cpu", "no code generation"),
])
def test_plan_states_what_compiling_costs_and_whether_it_pays_back(mode, device_type, fragment):
    lines = describe_plan(smoke_config(f"train.compile={mode}"), world_size=1, device_type=device_type)
    assert lines[-1].startswith(f"compile: {mode}") and fragment in lines[-1]


@pytest.mark.parametrize("override, fragment", [
    ("train.nonsense=1", "train.nonsense"),
    ("train.seq_len=9000", "exceeds model.max_seq_len"),
    ("train.precision=fp8", "train.precision"),
    ("model.top_k=9", "model.top_k"),
])
def test_bad_config_is_one_line_and_exit_2(builtin_data_dir, tmp_path, capsys, override, fragment):
    code = main(
        [
            "train",
            "--config",
            str(SMOKE),
            "--data",
            str(builtin_data_dir),
            "--run-dir",
            str(tmp_path / "r"),
            "--set",
            override,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and fragment in err
    assert err.startswith("pilotrun: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_existing_run_dir_and_missing_data_are_exit_2(builtin_data_dir, tmp_path, capsys):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "something").write_text("keep me")
    code = main(["train", "--config", str(SMOKE), "--data", str(builtin_data_dir), "--run-dir", str(run_dir)])
    err = capsys.readouterr().err  # a user's folder is not a run: no suggestion to resume it or to delete it
    assert (
        code == 2
        and "is not a run folder" in err
        and "choose a new --run-dir" in err
        and "--resume" not in err
    )
    assert (run_dir / "something").read_text() == "keep me"
    code = main(
        [
            "train",
            "--config",
            str(SMOKE),
            "--data",
            str(tmp_path / "nodata"),
            "--run-dir",
            str(tmp_path / "s"),
        ]
    )
    assert code == 2 and "nodata" in capsys.readouterr().err


@pytest.mark.slow
def test_qk_clip_events_mark_first_and_hard_clips_and_agree_with_the_windows(builtin_data_dir, tmp_path):
    from pilotrun.report.record_check.summarize import summarize_run

    # tau below the tiny model's max logits (~0.006-0.01): most heads are clipped, some hard (gamma < 0.5).
    config = smoke_config("optim.qk_clip.tau=0.004", "train.max_steps=5", "train.eval_every=0")
    train(config, builtin_data_dir, tmp_path / "run")
    events = strict_lines(tmp_path / "run")
    clips = [e for e in events if e["event"] == "qk_clip"]
    firsts = [(e["layer"], e["head"]) for e in clips if e["first_time"]]
    assert firsts and len(firsts) == len(set(firsts))  # each head's first clip is logged once
    windows_first = [
        tuple(pair) for e in events if e["event"] == "train" for pair in e["qk_clip"]["first_clipped"]
    ]
    assert sorted(firsts) == sorted(windows_first)
    for event in clips:
        assert event["max_logit"] > 0.004 and event["gamma"] * event["max_logit"] == pytest.approx(
            0.004, rel=1e-6
        )
        assert event["hard"] == (event["gamma"] < 0.5) and (event["first_time"] or event["hard"])
        # Logged after the update it follows: the counters include it, and a train window closes at that step.
        assert any(e["event"] == "train" and e["step"] == event["step"] for e in events)
    summary = summarize_run(tmp_path / "run")
    assert summary.valid, summary.reasons


@pytest.mark.slow
def test_the_expert_bias_freezes_in_the_final_fraction_of_the_schedule(builtin_data_dir, tmp_path):
    # horizon 10 with a 0.3 freeze: updates 0-6 move the aux-free bias, updates 7-9 must leave it exactly as
    # is.
    config = smoke_config(
        "train.max_steps=7",
        "optim.schedule.horizon=10",
        "optim.schedule.bias_freeze_fraction=0.3",
        "train.eval_every=0",
        "train.checkpoint_every=0",
    )
    trainer, _ = train(config, builtin_data_dir, tmp_path / "run")
    moving = [moe.gate.expert_bias.clone() for moe in trainer.session.raw_model.moe_layers()]
    assert all(bias.abs().sum() > 0 for bias in moving)
    resumed = smoke_config(
        "train.max_steps=10",
        "optim.schedule.horizon=10",
        "optim.schedule.bias_freeze_fraction=0.3",
        "train.eval_every=0",
        "train.checkpoint_every=0",
    )
    trainer, result = train(resumed, builtin_data_dir, tmp_path / "run", resume=True)
    assert result.step == 10
    assert all(
        torch.equal(moe.gate.expert_bias, bias)
        for moe, bias in zip(trainer.session.raw_model.moe_layers(), moving, strict=True)
    )
    speeds = [e["moe"]["bias_update_speed"] for e in strict_lines(tmp_path / "run") if e["event"] == "train"]
    assert speeds == [config.model.bias_update_speed] * 7 + [0.0] * 3


@pytest.mark.slow
def test_activation_checkpointing_trains_bit_identically(builtin_data_dir, tmp_path):
    results = {}
    for recompute in (False, True):
        config = smoke_config("train.max_steps=3", "train.eval_every=0", "train.checkpoint_every=0",
                              f"model.activation_checkpointing={str(recompute).lower()}")
        trainer, _ = train(config, builtin_data_dir, tmp_path / f"run-{recompute}")
        losses = [e["loss"] for e in strict_lines(tmp_path / f"run-{recompute}") if e["event"] == "train"]
        results[recompute] = (losses, trainer.session.raw_model.state_dict())
    assert results[True][0] == results[False][0]
    for name, value in results[False][1].items():
        assert torch.equal(results[True][1][name], value), name


@pytest.mark.slow
def test_train_events_carry_weight_and_update_rms_per_group(builtin_data_dir, tmp_path):
    config = smoke_config(
        "train.max_steps=5", "train.log_every=2", "train.eval_every=0", "train.checkpoint_every=3"
    )
    trainer, _ = train(config, builtin_data_dir, tmp_path / "run")
    groups = {group["name"] for group in trainer.session.optimizer.param_groups if group["params"]}
    trains = [e for e in strict_lines(tmp_path / "run") if e["event"] == "train"]
    assert [e["step"] for e in trains] == [2, 3, 4, 5]  # 3: the window a checkpoint closes early
    for event in trains:
        figures = event["optimizer"]
        assert set(figures["weight_rms"]) == groups and all(v > 0 for v in figures["weight_rms"].values())
        block_rms = event["activations"]["block_output_rms"]
        assert len(block_rms) == trainer.config.model.n_layers and all(v > 0 for v in block_rms)
        if event["step"] == 3:  # measured on the updates that close a log window, so not in this one
            assert figures["update_rms"] is None and figures["update_rms_step"] is None
            continue
        assert set(figures["update_rms"]) == groups and figures["update_rms_step"] == event["step"]
        assert 0.1 < figures["update_rms"]["attention"] < 0.3  # Muon, moonlight scale: ~0.2
    embedding = next(g for g in trainer.session.optimizer.param_groups if g["name"] == "embedding")["params"][
        0
    ]
    assert trains[-1]["optimizer"]["weight_rms"]["embedding"] == pytest.approx(
        float(embedding.detach().pow(2).mean().sqrt()), rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", [False, True])
def test_compiled_blocks_train_like_eager_ones(builtin_data_dir, tmp_path, recompute):
    # backend "eager": Dynamo traces every block (graph capture, guards) without inductor's C++ build, which
    # takes minutes on 2 cores. `sorted` dispatch and no CPU kernels on both sides: traced graphs use the
    # reference operators, so eager must too for a bit-for-bit comparison.
    results = {}
    for mode in ("none", "eager"):
        config = smoke_config("train.max_steps=3", "train.eval_every=0", "train.checkpoint_every=0",
                              f"train.compile={mode}", "model.moe_impl=sorted", "model.cpu_kernels=false",
                              f"model.activation_checkpointing={str(recompute).lower()}")
        trainer, result = train(config, builtin_data_dir, tmp_path / mode)
        assert result.step == 3
        events = [e for e in strict_lines(tmp_path / mode) if e["event"] == "train"]
        results[mode] = ([e["loss"] for e in events], [e["moe"]["tokens_per_expert"] for e in events],
                         trainer.session.raw_model.state_dict())
        compiled = [block._compiled_call_impl is not None for block in trainer.session.raw_model.layers]
        assert all(compiled) if mode == "eager" else not any(compiled)
    assert results["eager"][0] == results["none"][0]
    assert results["eager"][1] == results["none"][1]  # compiled forwards count, once
    for name, value in results["none"][2].items():
        assert torch.equal(results["eager"][2][name], value), name


def test_compile_mode_is_validated():
    with pytest.raises(ConfigError, match="train.compile must be one of"):
        smoke_config("train.compile=fast")
    with pytest.raises(ConfigError, match="YAML reads yes/no/on/off/true/false as booleans"):
        smoke_config("train.compile=off")


def test_a_keyboard_interrupt_in_an_update_ends_the_session_interrupted_not_in_error(
    builtin_data_dir, tmp_path, monkeypatch
):
    """Python's own Ctrl-C (SIGINT outside the stop signals, or the console script's default handling) raised
    in the middle of update 6: the session ends `interrupted`, exit 130, its message naming the newest
    committed checkpoint; the update in flight is not applied and nothing is written for it."""
    from pilotrun.training import loop as loop_module

    original, calls = loop_module.train_one_update, [0]

    def interrupted(loop):
        calls[0] += 1
        if calls[0] == 6:
            raise KeyboardInterrupt
        return original(loop)

    monkeypatch.setattr(loop_module, "train_one_update", interrupted)
    config = smoke_config("train.max_steps=20", "train.checkpoint_every=4", "train.eval_every=0",
                          "train.log_every=1")
    trainer, result = train(config, builtin_data_dir, tmp_path / "run")
    assert (result.reason, result.exit_code, result.step) == ("interrupted", 130, 5)
    end = strict_lines(tmp_path / "run")[-1]
    assert end["event"] == "session_end" and end["reason"] == "interrupted" and end["step"] == 5
    assert end["message"] == ("SIGINT (Ctrl-C), not one of this session's stop signals (--stop-signals): "
                              "stopped at once, no checkpoint for step 5; the newest committed checkpoint is "
                              "step 4")
    assert read_run_json(tmp_path / "run")["sessions"][-1]["end_reason"] == "interrupted"
