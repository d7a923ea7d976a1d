"""verdict through the real CLI on a run the real trainer made re-read its data: the smoke model on a training
split of one document, trained for five passes of the loader. The trainer logs a data_restart per pass after
the first; the verdict names the passes in data_passes and FAILs the run, or WARNs with a bound above five.
The loss of such a run falls (it learns the document), so loss_rise_at_end passes it."""

import json
from pathlib import Path

import pytest

from pilotrun.commands.cli import main
from pilotrun.data.prepare import prepare_corpus

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
# The smoke model's tiny MoE layer is never balanced and its clipping bound is meant for a longer schedule;
# a seconds-long run's throughput says nothing: those rules are not this test's subject.
LOOSE = ["--threshold", "max_imbalance=4", "--threshold", "min_throughput_ratio=0", "--threshold",
         "max_clip_rate=1", "--no-resume-required"]


@pytest.fixture(scope="module")
def reread_run(tmp_path_factory):
    """(run folder, batches one pass reads): five passes over a one-document training split."""
    root = tmp_path_factory.mktemp("reread")
    manifest = prepare_corpus(root / "data", source="builtin", tokenizer="bpe:300", train_tokens=600,
                              progress=False)
    split_tokens = manifest["splits"]["train"]["tokens"]
    batch_size, seq_len = 4, 32  # smoke.yaml's
    batches = ((split_tokens - 1) // seq_len) // batch_size
    run_dir = root / "run"
    args = ["train", "--config", str(SMOKE), "--data", str(root / "data"), "--run-dir", str(run_dir)]
    for override in ("train.num_threads=1", f"train.max_steps={5 * batches}", "train.eval_every=0",
                     "train.log_every=5", f"train.checkpoint_every={5 * batches}"):
        args += ["--set", override]
    assert main(args) == 0
    return run_dir, batches


def _verdict(capsys, run_dir, *extra):
    capsys.readouterr()
    code = main(["verdict", str(run_dir), "--json", *LOOSE, *extra])
    data = json.loads(capsys.readouterr().out)
    return code, {r["name"]: r for r in data["rules"]}


@pytest.mark.slow
def test_verdict_names_five_passes_over_the_training_split_and_fails_them(reread_run, capsys):
    run_dir, batches = reread_run
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["data_restarts"] for e in events if e["event"] == "data_restart"] == [1, 2, 3, 4]
    code, rules = _verdict(capsys, run_dir)
    assert code == 1
    found = rules["data_passes"]
    assert found["status"] == "FAIL"
    assert found["figure"].startswith("5.0 passes over the training split (4 restarts)")
    assert f"one pass = {batches} global batches of 128 tokens" in found["evidence"]
    assert rules["loss_rise_at_end"]["status"] == "PASS"
    assert [name for name, r in rules.items() if r["status"] == "FAIL"] == ["data_passes"]


@pytest.mark.slow
def test_verdict_warns_on_the_same_passes_under_a_higher_bound(reread_run, capsys):
    code, rules = _verdict(capsys, reread_run[0], "--threshold", "max_train_passes=5")
    assert code == 0
    assert rules["data_passes"]["status"] == "WARN" and "5.0 passes" in rules["data_passes"]["figure"]
