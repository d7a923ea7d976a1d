"""`torchrun --nproc_per_node=2 -m pilotrun train ...` end to end on the CPU (gloo, loopback).

One module-scoped set of runs on the built-in corpus, compared several ways:
- 2 ranks x batch 2 against 1 process x batch 4 (the same global batch and the same tokens): losses agree
  within 1e-5 relative (the gradient is summed over ranks in another order, so not bit for bit);
- a 2-rank run SIGKILLed inside a checkpoint write, then resumed with --resume, against an uninterrupted
  2-rank run: every loss after the resume and the final checkpoint's weights are identical, bit for bit;
- the world-size change rule: refused by default with the reason; allowed with the same global batch;
- only rank 0 writes the record, and its counters are global.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pilotrun.training.checkpoint.distributed_checkpointer import DistributedCheckpointer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ["--set", "train.max_steps=9", "--set", "train.checkpoint_every=3", "--set", "train.log_every=1",
          "--set", "train.eval_every=0", "--set", "train.num_threads=1", "--set", "train.keep_checkpoints=5",
          "--set", "optim.schedule.horizon=9"]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.update(extra or {})
    return env


def _train_command(data: Path, run_dir: Path, world_size: int, batch_size: int, *extra: str,
                   faults: tuple[str, ...] = ()) -> list[str]:
    # `faults`: checkpoint faults for every rank (tests/training/checkpoint/checkpoint_faults.py), run in
    # place of pilotrun.
    module = (
        ["-m", "tests.training.checkpoint.checkpoint_faults", *faults, "--"] if faults else ["-m", "pilotrun"]
    )
    launcher = (
        [sys.executable, *module]
        if world_size == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={world_size}",
            *module,
        ]
    )
    return launcher + ["train", "--config", str(ROOT / "configs" / "smoke.yaml"), "--data", str(data),
                       "--run-dir", str(run_dir), *RECIPE, "--set", f"train.batch_size={batch_size}", *extra]


def _run(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run to completion; a run still going after 300 s is a hang: every process of it dumps its Python stacks
    (faulthandler on SIGABRT) and the test fails with them, instead of a bare timeout that says nothing."""
    process = subprocess.Popen(command, cwd=ROOT, env=_env({"PYTHONFAULTHANDLER": "1", **(env or {})}),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        for pid in _descendants(process.pid):
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        time.sleep(5)
        for pid in _descendants(process.pid) + [process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stdout, stderr = process.communicate()
        pytest.fail(f"hung for 300 s: {' '.join(command)}\nstacks and output:\n{stderr[-12000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses_by_step(run_dir: Path, session: int = -1) -> dict[int, float]:
    events = _events(run_dir)
    sessions = [e["session_id"] for e in events if e["event"] == "session_start"]
    wanted = sessions[session]
    return {e["step"]: e["loss"] for e in events if e["event"] == "train" and e["session_id"] == wanted}


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    state, _ = DistributedCheckpointer(run_dir, keep=5).load()
    return state["model"]


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, children before grandchildren (from /proc: Linux only)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


@pytest.fixture(scope="module")
def runs(builtin_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distributed_runs")
    out = {name: root / name for name in ("one", "two", "killed")}
    one = subprocess.Popen(_train_command(builtin_data_dir, out["one"], 1, 4), cwd=ROOT, env=_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    two = _run(_train_command(builtin_data_dir, out["two"], 2, 2))
    assert two.returncode == 0, two.stderr[-3000:]
    stdout, stderr = one.communicate(timeout=300)
    assert one.returncode == 0, stderr[-3000:]

    # The killed run: every checkpoint write pauses 3 s between the shards and the commit; once step 3 is
    # committed and step 6's write has begun, SIGKILL the whole process group (torchrun and both ranks).
    with open(root / "killed.log", "w") as log:
        killed = subprocess.Popen(
            _train_command(builtin_data_dir, out["killed"], 2, 2, faults=("--write-delay", "3")),
            cwd=ROOT,
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    checkpoints = out["killed"] / "checkpoints"
    deadline = time.time() + 240
    try:
        while time.time() < deadline and killed.poll() is None:
            if (checkpoints / "step-00000003" / "COMMITTED.json").is_file() and \
                    any(checkpoints.glob(".tmp-step-00000006-*/.metadata")):
                break
            time.sleep(0.05)
    finally:
        # torchrun starts its workers in sessions of their own, so kill each of them by pid, then torchrun.
        for pid in _descendants(killed.pid) + [killed.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed.wait(30)
    assert killed.returncode == -signal.SIGKILL, "the run ended before it could be killed mid-checkpoint"
    assert DistributedCheckpointer(out["killed"], keep=5).committed_steps() == [3]
    resumed = _run(_train_command(builtin_data_dir, out["killed"], 2, 2, "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out["data"] = builtin_data_dir
    return out


def test_two_ranks_match_one_process_with_the_same_global_batch(runs: dict[str, Path]) -> None:
    one, two = _losses_by_step(runs["one"]), _losses_by_step(runs["two"])
    assert sorted(one) == sorted(two) == list(range(1, 10))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5), step
    assert len(set(one.values())) > 1  # it trained: the loss moved
    one_weights, two_weights = _final_weights(runs["one"]), _final_weights(runs["two"])
    for name, value in one_weights.items():
        torch.testing.assert_close(two_weights[name], value, rtol=1e-4, atol=1e-5)


def test_killed_and_resumed_two_rank_run_matches_uninterrupted_bit_for_bit(runs: dict[str, Path]) -> None:
    uninterrupted = _losses_by_step(runs["two"])
    resumed = _losses_by_step(runs["killed"], session=-1)
    assert sorted(resumed) == list(range(4, 10))
    for step, loss in resumed.items():
        assert loss == uninterrupted[step], step  # exact float equality
    straight, after_kill = _final_weights(runs["two"]), _final_weights(runs["killed"])
    assert straight.keys() == after_kill.keys()
    for name in straight:
        assert torch.equal(straight[name], after_kill[name]), name
    sessions = json.loads((runs["killed"] / "run.json").read_text())["sessions"]
    assert [s["resumed_from"] for s in sessions] == [None, 3]


def test_only_rank0_writes_the_record_and_its_counters_are_global(runs: dict[str, Path]) -> None:
    events = _events(runs["two"])
    starts = [e for e in events if e["event"] == "session_start"]
    assert len(starts) == 1 and starts[0]["world_size"] == 2  # a second writer would have logged its own
    assert starts[0]["tokens_per_microbatch"] == 2 * 32 * 2 and starts[0]["tokens_per_update"] == 128
    trains = [e for e in events if e["event"] == "train"]
    assert [e["step"] for e in trains] == list(range(1, 10))  # each update logged once, not once per rank
    assert all(e["window"]["tokens"] == 128 for e in trains)
    assert trains[-1]["tokens_seen"] == 9 * 128 == _events(runs["one"])[-1]["tokens_seen"]
    one_moe = [e["moe"]["tokens_per_expert"] for e in _events(runs["one"]) if e["event"] == "train"]
    two_moe = [e["moe"]["tokens_per_expert"] for e in trains]
    assert two_moe[0] == one_moe[0]  # summed over ranks: the global counts of the same global batch
    record = json.loads((runs["two"] / "run.json").read_text())
    assert record["tokens_per_update"] == 128 and record["sessions"][0]["hardware"]["world_size"] == 2
    files = {p.name for p in (runs["two"] / "checkpoints" / "step-00000009").iterdir()}
    assert files == {".metadata", "COMMITTED.json", "__0_0.distcp", "__1_0.distcp"}
    from pilotrun.report.record_check.summarize import summarize_run

    for name in ("two", "killed"):  # the record reconciles, the killed session's extra work rolled back
        summary = summarize_run(runs[name], require_step=9)
        assert summary.valid, (name, summary.reasons)


def _in_process(command: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """Run a one-process `pilotrun train` command inside this process (no interpreter start-up to pay):
    (exit code, stderr). torch's thread count is put back afterwards."""
    from pilotrun.commands.cli import main

    threads = torch.get_num_threads()
    try:
        code = main(command[command.index("train"):] + ["--set", "train.log_every=1"])
    finally:
        torch.set_num_threads(threads)
    return code, capsys.readouterr().err


def test_world_size_change_is_refused_with_the_reason(runs: dict[str, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "copy"
    shutil.copytree(runs["two"], run_dir)
    code, err = _in_process(
        _train_command(runs["data"], run_dir, 1, 2, "--resume", "--set", "train.max_steps=10"), capsys
    )
    assert code == 2
    assert "written by 2 rank(s), this run has 1" in err and "train.batch_size=4" in err
    code, err = _in_process(
        _train_command(runs["data"], run_dir, 1, 2, "--resume", "--allow-change", "world_size"), capsys
    )
    assert code == 2 and "global batch is 2 x 2 = 4" in err
    assert len(_events(run_dir)) == len(_events(runs["two"]))  # refusals wrote nothing


def test_allowed_world_size_change_continues_the_same_data(runs: dict[str, Path], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    """2 ranks -> 1 process at step 3 with the global batch kept: the same tokens, losses within rounding."""
    run_dir = tmp_path / "copy"
    shutil.copytree(runs["killed"], run_dir)
    code, err = _in_process(_train_command(runs["data"], run_dir, 1, 4, "--resume", "--from-step", "3",
                                           "--allow-change", "world_size"), capsys)
    assert code == 0, err[-3000:]
    changed = _losses_by_step(run_dir)
    reference = _losses_by_step(runs["two"])
    assert sorted(changed) == list(range(4, 10))
    for step, loss in changed.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step
    record = json.loads((run_dir / "run.json").read_text())
    assert any(
        c["key"] == "world_size" and c["old"] == 2 and c["new"] == 1 for c in record["allowed_changes"]
    )
    assert any("world size changed 2 -> 1" in note for note in record["sessions"][-1]["notes"])
    assert record["tokens_per_update"] == 128


def test_fsdp2_run_matches_one_process_and_resumes_bit_for_bit(runs: dict[str, Path], tmp_path: Path) -> None:
    """FSDP2 (`train.parallelism=fsdp`, DTensor shards, Muon on gathered matrices) on 2 gloo ranks: the same
    losses as one process within 1e-5 relative; resumed from its step-3 checkpoint (sharded DCP), the replayed
    steps 4..9 equal the first session's bit for bit."""
    run_dir = tmp_path / "fsdp"
    first = _run(_train_command(runs["data"], run_dir, 2, 2, "--set", "train.parallelism=fsdp"))
    assert first.returncode == 0, first.stderr[-3000:]
    fsdp, one = _losses_by_step(run_dir), _losses_by_step(runs["one"])
    assert sorted(fsdp) == list(range(1, 10))
    for step in one:
        assert fsdp[step] == pytest.approx(one[step], rel=1e-5), step
    again = _run(_train_command(runs["data"], run_dir, 2, 2, "--set", "train.parallelism=fsdp", "--resume",
                                "--from-step", "3"))
    assert again.returncode == 0, again.stderr[-3000:]
    replayed = _losses_by_step(run_dir, session=-1)
    assert sorted(replayed) == list(range(4, 10))
    assert all(replayed[step] == fsdp[step] for step in replayed)


def test_fp16_skip_decisions_are_agreed_by_both_ranks(runs: dict[str, Path], tmp_path: Path) -> None:
    """fp16 with an absurd initial loss scale: the first updates overflow and are skipped until the scale has
    backed off below fp16's range. DDP reduces the gradients before the check, so both ranks see the same inf
    and skip together: the replica fingerprint check at each checkpoint (checkpointing.save_checkpoint) finds
    them identical, or the run would fail; the record counts each skip once."""
    run_dir = tmp_path / "fp16"
    done = _run(_train_command(runs["data"], run_dir, 2, 2, "--set", "train.precision=fp16", "--set",
                               "train.loss_scale_init=1e12", "--set", "train.max_steps=4"))
    assert done.returncode == 0, done.stderr[-3000:]
    events = _events(run_dir)
    skipped = [e["updates_attempted"] for e in events if e["event"] == "overflow"]
    assert skipped[:10] == list(range(1, 11))  # 1e12 halves about 23 times before the first applied update
    scales = [e["loss_scale_after"] for e in events if e["event"] == "overflow"]
    assert all(later < earlier for earlier, later in zip(scales, scales[1:]))
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [3, 4]
    last = events[-1]
    assert last["event"] == "session_end" and last["step"] == 4 and last["updates_skipped"] == len(skipped)
    assert last["updates_attempted"] == 4 + len(skipped)


def test_activation_checkpointing_and_replicated_newton_schulz_give_the_same_two_rank_run(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """Two switches that must not change a DDP run's numbers: activation checkpointing (each block recomputed
    in backward under DDP's hooks) and Newton-Schulz replicated on every rank instead of shared out (the
    default the fixture's run used). Both give the fixture's 2-rank losses and final weights bit for bit."""
    for name, extra in (("recompute", ["--set", "model.activation_checkpointing=true"]),
                        ("replicated_ns", ["--set", "optim.muon.distribute_newton_schulz=false"])):
        run_dir = tmp_path / name
        done = _run(_train_command(runs["data"], run_dir, 2, 2, *extra))
        assert done.returncode == 0, done.stderr[-3000:]
        assert _losses_by_step(run_dir) == _losses_by_step(runs["two"]), name  # exact float equality
        reference, weights = _final_weights(runs["two"]), _final_weights(run_dir)
        for key, value in reference.items():
            assert torch.equal(weights[key], value), (name, key)


def test_two_rank_dcp_checkpoint_exports_for_transformers(runs: dict[str, Path], tmp_path: Path) -> None:
    """`pilotrun export` of the 2-rank run's checkpoint (written by torch.distributed.checkpoint under
    torchrun), on one process: the weights equal the checkpoint's, and transformers gives the same logits."""
    transformers = pytest.importorskip("transformers")
    from pilotrun.commands.cli import main
    from pilotrun.commands.export import load_checkpoint_model

    assert DistributedCheckpointer(runs["two"], keep=5).storage_name(9) == "torch_dcp"
    assert main(["export", str(runs["two"]), "--out", str(tmp_path / "hf")]) == 0
    model, config, _meta, step, _marker = load_checkpoint_model(runs["two"])
    saved = _final_weights(runs["two"])
    state = model.state_dict()
    assert step == 9 and sorted(saved) == sorted(state)
    assert all(torch.equal(state[name], saved[name]) for name in saved)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, config.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        difference = (model(tokens).logits - hf_model(tokens).logits).abs().max().item()
    assert difference < 1e-5
