"""Training on a data mixture, end to end: the per-source account reconciles exactly with the counters, the
verdict names a small source's passes, a mixture of one folder writes the record `--data FOLDER` writes, the
stream is the same on 1 and 2 gloo ranks, and a SIGKILLed run resumes bit for bit."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pilotrun.config import load_run_config
from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.report.verdict.verdict import judge
from pilotrun.run.marker import MARKER_NAME
from tests.conftest import write_mixture
from tests.exactness import assert_exactly_equal

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ["train.max_steps=6", "train.num_threads=1", "train.log_every=1", "train.eval_every=3",
            "train.checkpoint_every=2", "train.keep_checkpoints=5", "optim.schedule.horizon=6"]


def recipe(*extra: str):
    return load_run_config(ROOT / "configs" / "smoke.yaml", [*SETTINGS, *extra])


def train(data, run_dir, *extra: str, **kwargs):
    from pilotrun.training.trainer import Trainer

    trainer = Trainer(recipe(*extra), data, run_dir, progress=False, out=io.StringIO(), **kwargs)
    assert trainer.run().reason == "completed"
    return trainer


def events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


@pytest.fixture(scope="module")
def seventy_thirty(mixture_sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture_run")
    mixture = write_mixture(
        root / "mix.yaml", [(mixture_sources["edu"], 0.7), (mixture_sources["builtin"], 0.3)]
    )
    train(mixture, root / "run")
    return mixture, root / "run"


def test_tokens_per_source_add_up_to_tokens_seen_and_match_the_weights_to_the_row(seventy_thirty):
    _, run_dir = seventy_thirty
    row = 32  # seq_len: one row's tokens
    for event in events(run_dir, "train"):
        seen = event["tokens_seen_by_source"]
        assert sum(seen.values()) == event["tokens_seen"]
        assert sum(event["tokens_by_source"].values()) == event["window"]["tokens"]
        assert (
            abs(seen["edu"] - 0.7 * event["tokens_seen"]) < row
            and abs(seen["builtin"] - 0.3 * event["tokens_seen"]) < row
        )
    vals = events(run_dir, "val")
    assert vals and all(set(v["loss_by_source"]) == {"edu", "builtin"} for v in vals)
    assert all(
        v["loss"] == (0.7 * v["loss_by_source"]["edu"] + 0.3 * v["loss_by_source"]["builtin"]) / 1.0
        for v in vals
    )
    run = json.loads((run_dir / "run.json").read_text())
    assert [s["name"] for s in run["data"]["sources"]] == ["edu", "builtin"]
    assert run["data"]["mixture"] == {"weights": [0.7, 0.3], "seed": 0}
    assert all(len(s["metadata_sha256"]) == 64 for s in run["data"]["sources"])
    summary = summarize_run(run_dir)
    assert summary.valid, summary.reasons
    shares = {r["name"]: r["tokens_seen"] for r in summary.overall["mixture"]["sources"]}
    assert sum(shares.values()) == summary.final.tokens_seen


def test_summarize_refuses_per_source_tokens_that_do_not_add_up(seventy_thirty, tmp_path):
    import shutil

    _, run_dir = seventy_thirty
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    from pilotrun.report.record_check.mixture_account import mixture_problems

    run = json.loads((copy / "run.json").read_text())
    bad = events(copy, "train")
    bad[2]["tokens_seen_by_source"]["edu"] += 32
    assert any("add up to" in p for p in mixture_problems(run, bad))


def test_a_small_source_restarts_alone_and_the_verdict_names_its_passes(mixture_sources, tmp_path):
    mixture = write_mixture(
        tmp_path / "mix.yaml", [(mixture_sources["edu"], 0.1), (mixture_sources["tiny"], 0.9)]
    )
    # tiny: 25 windows, asked for 58 rows
    trainer = train(mixture, tmp_path / "run", "train.eval_every=0", "train.max_steps=16",
                    "optim.schedule.horizon=16", "train.checkpoint_every=8")
    last = events(tmp_path / "run", "train")[-1]
    assert last["restarts_by_source"]["edu"] == 0 and last["restarts_by_source"]["tiny"] >= 1
    # each restart said in the log when it happens, naming the source and the pass it begins
    said = [line for line in trainer.out.getvalue().splitlines() if line.startswith("data: ")]
    assert said == [f"data: the mixture reads 'tiny' (pass {number}) again from its start at step "
                    f"{e['step']:,} (tokens_seen {e['tokens_seen']:,}); the training loss from here is "
                    "partly on tokens already trained on"
                    for number, e in enumerate(events(tmp_path / "run", "data_restart"), start=2)]
    assert len(said) == last["restarts_by_source"]["tiny"]
    from pilotrun.report.drawing.marks import run_marks

    summary = summarize_run(tmp_path / "run")
    marks = run_marks(summary)
    assert [m.step for m in marks] == [e["step"] for e in events(tmp_path / "run", "data_restart")]
    assert {m.label for m in marks} == {"source tiny again"}
    # passes per source wherever passes are reported: each over its own split, never the pooled figure
    by_source = summary.overall["passes_by_source"]
    seq_len = summary.run["recipe"]["train"]["seq_len"]
    splits = {s["name"]: s["train"]["tokens"] for s in summary.run["data"]["sources"]}
    seen = last["tokens_seen_by_source"]
    one_pass = {name: ((splits[name] - 1) // seq_len) * seq_len for name in splits}
    assert by_source == {name: seen[name] / one_pass[name] for name in ("tiny", "edu")}
    assert list(by_source) == ["tiny", "edu"] and by_source["tiny"] > 1 > by_source["edu"]
    from pilotrun.report.drawing.html import render_html

    html = render_html(judge(tmp_path / "run"), {})
    assert (f"<tr><th>passes over each source&#x27;s training split</th><td>tiny {by_source['tiny']:.3g}, "
            f"edu {by_source['edu']:.3g}</td></tr>") in html
    assert "<th>passes over the training split</th>" not in html  # the pooled row, gone
    from pilotrun.report.record_check.summarize import format_summary

    text = format_summary(summary)
    assert (f"passes over each source's training split tiny {by_source['tiny']:.3g}, edu "
            f"{by_source['edu']:.3g}") in text and "passes over the training split" not in text
    from pilotrun.report.projection.forecast_record import lock_forecast

    tokens = 160 * summary.run["tokens_per_update"]
    projected = lock_forecast(summary, 160)["assumes"]["passes_by_source"]  # 10x the pilot's 16 updates
    assert projected == {"tiny": tokens * 0.9 / one_pass["tiny"], "edu": tokens * 0.1 / one_pass["edu"]}
    finding = next(r for r in judge(tmp_path / "run").rules if r.name == "data_passes")
    assert finding.status in ("WARN", "FAIL") and "source tiny" in finding.figure


def test_a_mixture_of_one_folder_writes_the_record_of_that_folder(mixture_sources, tmp_path):
    folder = train(mixture_sources["edu"], tmp_path / "folder", "train.max_steps=2")
    mixed = train(write_mixture(tmp_path / "one.yaml", [(mixture_sources["edu"], 0.4)]), tmp_path / "mixed",
                  "train.max_steps=2")
    assert folder.session.data_section() == mixed.session.data_section()
    runs = [json.loads((tmp_path / name / "run.json").read_text()) for name in ("folder", "mixed")]
    assert runs[0]["data"] == runs[1]["data"]
    losses = [[e["loss"] for e in events(tmp_path / name, "train")] for name in ("folder", "mixed")]
    assert losses[0] == losses[1]
    assert all("tokens_by_source" not in e for e in events(tmp_path / "mixed", "train"))


def _command(mixture: Path, run_dir: Path, world_size: int, batch_size: int, *extra: str) -> list[str]:
    launcher = (
        [sys.executable, "-m", "pilotrun"]
        if world_size == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={world_size}",
            "-m",
            "pilotrun",
        ]
    )
    sets = [arg for key in SETTINGS for arg in ("--set", key)]
    return launcher + ["train", "--config", str(ROOT / "configs" / "smoke.yaml"), "--data", str(mixture),
                       "--run-dir", str(run_dir), "--progress", "none", *sets, "--set",
                       f"train.batch_size={batch_size}", *extra]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def test_the_same_global_batches_on_one_and_two_gloo_ranks(seventy_thirty, tmp_path):
    mixture, one_rank = seventy_thirty
    done = subprocess.run(
        _command(mixture, tmp_path / "two", 2, 2),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = events(one_rank, "train"), events(tmp_path / "two", "train")
    assert [e["tokens_seen_by_source"] for e in one] == [e["tokens_seen_by_source"] for e in two]
    # The same tokens: the losses agree up to the order of the gradient's sum over ranks.
    assert all(abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]) for a, b in zip(one, two, strict=True))
    # Two ranks resume a sharded (DCP) checkpoint of the mixture's cursor exactly.
    done = subprocess.run(_command(mixture, tmp_path / "two", 2, 2, "--resume", "--from-step", "4"), cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    again = events(tmp_path / "two", "train")[len(two):]
    assert [(e["step"], e["loss"], e["tokens_seen_by_source"]) for e in again] == \
        [(e["step"], e["loss"], e["tokens_seen_by_source"]) for e in two[4:]]


def test_a_sigkill_and_resume_is_bit_exact(seventy_thirty, tmp_path):
    mixture, straight = seventy_thirty
    run_dir = tmp_path / "killed"
    process = subprocess.Popen(
        _command(mixture, run_dir, 1, 4),
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoints" / "step-00000004" / MARKER_NAME).exists() and process.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint at step 4 within 300 s"
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before the kill"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not events(run_dir, "session_end")  # killed, not ended
    done = subprocess.run(
        _command(mixture, run_dir, 1, 4, "--resume"),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    want = {e["step"]: (e["loss"], e["tokens_seen_by_source"]) for e in events(straight, "train")}
    for event in events(run_dir, "train"):
        assert (event["loss"], event["tokens_seen_by_source"]) == want[event["step"]]
    from pilotrun.training.checkpoint.checkpointer import Checkpointer

    a, _ = Checkpointer(straight, keep=5).load(6)
    b, _ = Checkpointer(run_dir, keep=5).load(6)
    assert_exactly_equal(a["model"], b["model"])
    assert_exactly_equal(a["trainer"], b["trainer"])
    assert summarize_run(run_dir).valid


def test_inspect_batch_names_each_rows_source_and_its_position_there(seventy_thirty):
    from pilotrun.commands.inspect_batch import inspect_batch
    from pilotrun.data.mixed_reader import MixedLoader, open_data

    mixture, run_dir = seventy_thirty
    rows = [line for line in inspect_batch(run_dir, 3).splitlines() if line.startswith("microbatch")]
    described = MixedLoader(open_data(mixture), batch_size=4, seq_len=32).describe_batch(2)
    assert len(rows) == 4
    for line, row in zip(rows, described, strict=True):
        assert line.startswith(f"microbatch 2 rank 0 row {row['row']} source {row['source']} row "
                               f"{row['source_row']} (pass 0): 33 tokens from ")


def test_trackers_get_the_validation_loss_and_tokens_of_each_source(seventy_thirty):
    from pilotrun.run.mirror import scalar_fields

    _, run_dir = seventy_thirty
    val = dict(scalar_fields(events(run_dir, "val")[-1]))
    assert {"val/loss_by_source/edu", "val/loss_by_source/builtin"} <= set(val)
    train_tags = dict(scalar_fields(events(run_dir, "train")[-1]))
    assert {"train/tokens_by_source/edu", "train/tokens_seen_by_source/builtin"} <= set(train_tags)


def test_a_weight_changed_on_resume_is_refused_unless_allowed_then_recorded(seventy_thirty, mixture_sources,
                                                                            tmp_path):
    import shutil

    from pilotrun.common.errors import CheckpointError
    from pilotrun.training.trainer import Trainer

    _, straight = seventy_thirty
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    even = write_mixture(
        tmp_path / "even.yaml", [(mixture_sources["edu"], 0.5), (mixture_sources["builtin"], 0.5)]
    )
    with pytest.raises(CheckpointError, match=r"data\.mixture\.weights: \[0\.7, 0\.3\] -> \[0\.5, 0\.5\]"):
        Trainer(recipe(), even, run_dir, resume=True, from_step=4, progress=False, out=io.StringIO())
    trainer = train(even, run_dir, resume=True, from_step=4, allow_changes=["data.mixture.weights"])
    assert ("recipe change at resume: data.mixture.weights [0.7, 0.3] -> [0.5, 0.5] from update 5 (allowed "
            "by --allow-change)") in trainer.out.getvalue().splitlines()
    run = json.loads((run_dir / "run.json").read_text())
    change = run["allowed_changes"][-1]
    assert change["key"] == "data.mixture.weights" and change["new"] == [0.5, 0.5]
    session = next(s for s in run["sessions"] if s["session_id"] == change["session_id"])
    assert session["start_step"] == 4 and run["data"]["mixture"]["weights"] == [0.5, 0.5]
    resumed = [e for e in events(run_dir, "train") if e["session_id"] == trainer.session.session_id]
    assert [e["tokens_by_source"] for e in resumed] == [{"edu": 64, "builtin": 64}] * 2  # 2 of 4 rows each
    assert summarize_run(run_dir).valid, summarize_run(run_dir).reasons
    finding = next(r for r in judge(run_dir).rules if r.name == "recipe_changes")
    assert finding.status == "WARN" and "data.mixture.weights" in finding.figure


def test_the_lock_records_every_source_the_weights_and_the_seed(seventy_thirty, mixture_sources, tmp_path):
    from pilotrun.commands.freeze import freeze_run
    from pilotrun.data.mixed_reader import data_identity
    from pilotrun.run.recipe_lock import FreezeError, frozen_run_facts

    mixture, run_dir = seventy_thirty
    _, lock, _ = freeze_run(run_dir, tmp_path / "lock.json", despite_no_go=True)
    run = json.loads((run_dir / "run.json").read_text())
    assert lock["data"]["mixture"] == {"weights": [0.7, 0.3], "seed": 0}
    assert [s["metadata_sha256"] for s in lock["data"]["sources"]] == [s["metadata_sha256"] for s in
                                                                       run["data"]["sources"]]
    sha, same = data_identity(mixture)
    assert sha == lock["data"]["metadata_sha256"]
    assert (
        frozen_run_facts(lock, tmp_path / "lock.json", run["recipe"], sha, [], mixture=same)["differences"]
        == []
    )
    sha, heavier = data_identity(
        write_mixture(
            tmp_path / "m.yaml", [(mixture_sources["edu"], 0.9), (mixture_sources["builtin"], 0.1)], seed=3
        )
    )
    with pytest.raises(FreezeError, match=r"data\.mixture\.seed .*data\.mixture\.weights"):
        frozen_run_facts(lock, tmp_path / "lock.json", run["recipe"], sha, [], mixture=heavier)
    facts = frozen_run_facts(lock, tmp_path / "lock.json", run["recipe"], sha,
                             ["data.mixture.weights", "data.mixture.seed"], mixture=heavier)
    assert [d["key"] for d in facts["differences"]] == ["data.mixture.seed", "data.mixture.weights"]


def test_summarize_and_the_verdict_report_show_each_source_against_its_weight(seventy_thirty):
    from pilotrun.report.drawing.html import render_html
    from pilotrun.report.record_check.summarize import format_summary

    _, run_dir = seventy_thirty
    verdict = judge(run_dir)
    text = format_summary(verdict.summary)
    assert "data mixture (seed 0)" in text and "  edu: weight 0.7 (share 0.7000), tokens " in text
    html = render_html(verdict, {})
    assert "source builtin: weight (share) / kept tokens (share) / restarts / last val loss" in html


def test_inspect_batch_quotes_a_hostile_source_name_on_its_own_line(mixture_sources, tmp_path):
    """A source `name` from the mixture file carrying an escape sequence, a bell and a newline: inspect-batch
    prints it escaped, never as commands to the terminal or as a line of its own."""
    import yaml

    from pilotrun.commands.inspect_batch import inspect_batch

    hostile = "edu\x1b]0;owned\x07\nmicrobatch 99 fake"
    mixture = tmp_path / "mix.yaml"
    mixture.write_text(
        yaml.safe_dump(
            {
                "mixture": [
                    {"path": str(mixture_sources["edu"]), "weight": 1, "name": hostile},
                    {"path": str(mixture_sources["builtin"]), "weight": 1},
                ]
            }
        )
    )
    train(mixture, tmp_path / "run", "train.max_steps=2", "train.eval_every=0")
    said = inspect_batch(tmp_path / "run", 2)
    assert not any(c in said for c in "\x1b\x07") and "edu\\x1b]0;owned\\x07\\nmicrobatch 99 fake" in said
    assert not [line for line in said.splitlines() if line.startswith("microbatch 99 fake")]


def test_weights_near_a_floats_limit_give_a_finite_val_loss_and_a_valid_record(mixture_sources, tmp_path):
    from pilotrun.report.record_check.summarize import summarize_run

    mixture = write_mixture(tmp_path / "mix.yaml", [(mixture_sources["edu"], "1.0e+308"),
                                                    (mixture_sources["builtin"], 1)])
    train(mixture, tmp_path / "run", "train.max_steps=2", "train.eval_every=2", "optim.schedule.horizon=2")
    (val,) = events(tmp_path / "run", "val")
    assert math.isfinite(val["loss"]) and val["loss"] == val["loss_by_source"]["edu"]
    assert summarize_run(tmp_path / "run").valid
