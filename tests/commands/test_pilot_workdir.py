"""pilot: a reused WORKDIR. Its prepared data is reused only when it is what this call would prepare, else the
call is refused before anything changes; and the prepare inside the pilot writes no carriage return to a log.

The tests stop the pilot at its first training (a stand-in for the training child): what happens to
WORKDIR/data is decided before that, so each call takes a second or two instead of a rehearsal."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from pilotrun.commands import pilot
from pilotrun.commands.cli import main
from pilotrun.commands.pilot import PREPARE_OPTIONS, PilotError

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures"
JSONL = FIXTURES / "fineweb-edu" / "fineweb_edu_sample10bt_150docs.jsonl"
PARQUET = FIXTURES / "fineweb-edu" / "fineweb_edu_sample10bt_150docs.parquet"
GPT2 = FIXTURES / "tokenizers" / "gpt2" / "tokenizer.json"
STAND_IN = "stand-in: this test stops the pilot where its first training would start"

pytestmark = [pytest.mark.shared_fixtures,
              pytest.mark.skipif(not JSONL.is_file() or not GPT2.is_file(),
                                 reason="the FineWeb-Edu and GPT-2 fixtures (../shared/fixtures) are not on "
                                 "this machine")]


@pytest.fixture
def trainings(monkeypatch) -> list[list[str]]:
    """The training children the pilot starts, each refused at once (exit 2 with the stand-in's line)."""
    started: list[list[str]] = []

    def refuse(train_args, log, nproc=None):
        started.append(train_args)
        raise PilotError(STAND_IN)

    monkeypatch.setattr(pilot, "TrainingChild", refuse)
    return started


def pilot_call(workdir: Path, *options: str) -> int:
    return main(["pilot", "--workdir", str(workdir), "--config", "smoke", *options])


def snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    """Every file under `folder`: its modification time and content hash (nothing changed = an equal
    snapshot)."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def prepared_workdir(tmp_path: Path, tokenizer: Path = GPT2) -> Path:
    """A workdir whose data the pilot prepared from the JSONL fixture, with its earlier run folder beside
    it."""
    from pilotrun.data.prepare import prepare_corpus

    workdir = tmp_path / "w"
    prepare_corpus(
        workdir / "data", source=str(JSONL), tokenizer=str(tokenizer), progress=False, **PREPARE_OPTIONS
    )
    (workdir / "run").mkdir()
    (workdir / "run" / "metrics.jsonl").write_text("{}\n")
    (workdir / pilot.PILOT_MARKER).write_text("made by the pilot\n")
    return workdir


def test_a_second_call_with_the_same_inputs_reuses_the_data_and_says_so(tmp_path, capsys, trainings):
    workdir = tmp_path / "w"
    options = ["--source", str(JSONL), "--tokenizer", str(GPT2)]
    assert pilot_call(workdir, *options) == 2 and capsys.readouterr().err.strip().endswith(STAND_IN)
    data = snapshot(workdir / "data")
    assert "metadata.json" in data
    assert pilot_call(workdir, *options) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().endswith(STAND_IN) and len(trainings) == 2  # reached its training both times
    reuse = [line for line in captured.out.splitlines() if "data already prepared" in line]
    assert reuse == [line for line in captured.out.splitlines() if str(workdir / "data") in line]
    assert len(reuse) == 1 and reuse[0].startswith(
        f"[pilot] reusing the data already prepared in {workdir / 'data'}: "
        "the same source, tokenizer and options"
    )
    assert "preparing" not in captured.out
    assert snapshot(workdir / "data") == data


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (
            ["--source", str(JSONL), "--tokenizer", "bpe:512"],
            "tokenizer: prepared with a tokenizer file with sha256 ",
        ),
        (
            ["--source", str(PARQUET), "--tokenizer", str(GPT2)],
            "source: prepared from local fineweb_edu_sample10bt_150docs.jsonl",
        ),
        ([], "this call asks for builtin (Python "),  # the defaults: the built-in corpus and bpe:2048
    ],
)
def test_other_inputs_are_refused_in_one_line_before_anything_changes(
    tmp_path, capsys, trainings, options, named
):
    workdir = prepared_workdir(tmp_path)
    before = snapshot(workdir)
    capsys.readouterr()  # the setup's own prepare (its small-val warning) is not the pilot's output
    assert pilot_call(workdir, *options) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and named in err, err
    assert f"{workdir / 'data'} was prepared from other inputs than this call asks for" in err
    assert "choose another --workdir, or pass --reprepare" in err
    assert trainings == [] and snapshot(workdir) == before  # the old run folder is still there too


def test_a_tokenizer_file_edited_under_the_same_path_is_another_tokenizer(tmp_path, capsys, trainings):
    from tokenizers import Tokenizer

    mine = tmp_path / "tok" / "tokenizer.json"
    mine.parent.mkdir()
    shutil.copy(GPT2, mine)
    workdir = prepared_workdir(tmp_path, tokenizer=mine)
    edited = Tokenizer.from_file(str(mine))
    edited.add_special_tokens(["<|mine|>"])
    edited.save(str(mine))
    capsys.readouterr()
    assert pilot_call(workdir, "--source", str(JSONL), "--tokenizer", str(mine)) == 2
    err = capsys.readouterr().err
    recorded = json.loads((workdir / "data" / "metadata.json").read_text())["tokenizer"]["sha256"]
    assert f"tokenizer: prepared with a tokenizer file with sha256 {recorded[:12]}, this call asks for" in err
    assert trainings == []


def test_reprepare_prepares_the_data_again_with_plain_progress_in_the_log(tmp_path, capsys, trainings):
    workdir = prepared_workdir(tmp_path)
    assert pilot_call(workdir, "--source", str(JSONL), "--tokenizer", "bpe:512", "--reprepare") == 2
    captured = capsys.readouterr()
    assert captured.err.strip().endswith(STAND_IN) and len(trainings) == 1
    manifest = json.loads((workdir / "data" / "metadata.json").read_text())
    assert manifest["tokenizer"]["kind"] == "bpe" and manifest["tokenizer"]["requested_vocab_size"] == 512
    assert f"[pilot] preparing {JSONL} into {workdir / 'data'} (tokenizer bpe:512)" in captured.out
    # Neither stream is a terminal here: the prepare's progress is plain lines, as the pilot's own.
    assert "\r" not in captured.out + captured.err
    assert any(line.startswith("prepare (documents): 150/150 doc") for line in captured.err.splitlines())


def test_reprepare_with_a_data_folder_is_refused(tmp_path, capsys):
    assert pilot_call(tmp_path / "w", "--data", str(tmp_path), "--reprepare") == 2
    assert "--reprepare prepares WORKDIR/data again" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_a_whole_pilot_into_a_log_file_has_plain_lines_and_no_carriage_return(tmp_path):
    # `pilotrun pilot > log 2>&1`, as under nohup or slurm: the prepare, the pilot's own progress while each
    # training child runs, and the verdict all arrive as lines.
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    log = tmp_path / "pilot.log"
    with open(log, "w") as handle:
        code = subprocess.call(
            [
                sys.executable,
                "-m",
                "pilotrun",
                "pilot",
                "--workdir",
                str(tmp_path / "w"),
                "--config",
                "smoke",
                "--set",
                "train.num_threads=1",
                "--source",
                str(JSONL),
                "--tokenizer",
                str(GPT2),
            ],
            cwd=root,
            env=dict(os.environ, PYTHONPATH=str(root)),
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    text = log.read_text()
    assert code in (0, 1) and "VERDICT: " in text, text[-3000:]
    assert "\r" not in text
    lines = text.splitlines()
    assert any(line.startswith("prepare (documents): 150/150 doc (100%)") for line in lines)
    assert any(line.startswith("[pilot] step 6/6") for line in lines)  # the resumed child's last window
