"""`pilotrun prepare --engine datatrove`: the same documents and counts per split as `pilotrun prepare`, a
folder that verifies and trains, the same bytes for any --workers, and what the SLURM executor submits (an
sbatch shim on PATH records each submission)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

pytest.importorskip("datatrove")

from pilotrun.commands.cli import main  # noqa: E402
from pilotrun.data.datatrove_prepare import SlurmOptions, prepare_with_datatrove  # noqa: E402
from pilotrun.data.prepare import prepare_corpus  # noqa: E402
from pilotrun.data.shards import metadata_sha256  # noqa: E402
from pilotrun.data.verify import verify_data  # noqa: E402
from tests.commands.test_cli_bad_input import tree_state  # noqa: E402
from tests.data.datatrove_helpers import prepare_fixture as _prepare  # noqa: E402


def test_counts_and_source_equal_pilotrun_prepare_and_the_folder_verifies(in_process, corpus, tmp_path,
                                                                        gpt2_tokenizer_path):
    manifest = _prepare(corpus, tmp_path / "dt", gpt2_tokenizer_path, tasks=2)
    reference = prepare_corpus(tmp_path / "ref", str(corpus / "*.jsonl"), str(gpt2_tokenizer_path),
                               val_fraction=0.1, shard_tokens=5000, workers=1, progress=False)
    for split in ("train", "val"):
        for count in ("documents", "tokens"):
            assert manifest["splits"][split][count] == reference["splits"][split][count], (split, count)
    assert manifest["splits"]["val"]["documents"] > 0
    assert manifest["source"] == reference["source"]  # the files with their sha256, as prepare names them
    assert (
        manifest["stream"]["empty_documents_skipped"] == reference["stream"]["empty_documents_skipped"] == 1
    )
    assert manifest["engine"]["name"] == "datatrove" and manifest["engine"]["tasks"] == 2
    assert manifest["engine"]["version"].startswith("0.10")
    assert manifest["engine"]["input_order"]["files"] == 3 and "order_within_split" in manifest["engine"]
    assert manifest["split_rule"] == reference["split_rule"]
    assert verify_data(tmp_path / "dt") == []
    assert json.loads((tmp_path / "dt" / "metadata.json").read_text()) == manifest
    assert (
        not (tmp_path / "dt.partial").exists()
        and (tmp_path / "dt.logs" / "logs" / "task_00001.log").is_file()
    )


def test_parquet_input_gives_prepare_s_counts(in_process, tmp_path, fineweb_parquet, gpt2_tokenizer_path):
    manifest = prepare_with_datatrove(tmp_path / "dt", str(fineweb_parquet), str(gpt2_tokenizer_path))
    reference = prepare_corpus(tmp_path / "ref", str(fineweb_parquet), str(gpt2_tokenizer_path), workers=1,
                               progress=False)
    assert {s: manifest["splits"][s]["tokens"] for s in ("train", "val")} == \
        {s: reference["splits"][s]["tokens"] for s in ("train", "val")}
    assert manifest["engine"]["tasks"] == 1 and verify_data(tmp_path / "dt") == []


def _shims(folder: Path) -> Path:
    """`sbatch` that records each submission (its arguments and the script) and answers a job id."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text('#!/bin/sh\nn=$(ls "$SHIM_RECORD" | wc -l)\nn=$((n + 1))\nmkdir "$SHIM_RECORD/$n"\n'
                      'for a in "$@"; do echo "$a"; done > "$SHIM_RECORD/$n/args"\n'
                      'eval last=\\${$#}\ncp "$last" "$SHIM_RECORD/$n/script"\n'
                      'echo "Submitted batch job $((1000 + n))"\n')
    sbatch.chmod(sbatch.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def test_slurm_submits_a_task_array_and_a_merge_that_depends_on_it(monkeypatch, capsys, corpus, tmp_path,
                                                                   gpt2_tokenizer_path):
    record = tmp_path / "submitted"
    record.mkdir()
    monkeypatch.setenv("PATH", f"{_shims(tmp_path)}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SHIM_RECORD", str(record))
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    out = tmp_path / "dt"
    command = [
            "prepare",
            "--engine",
            "datatrove",
            "--executor",
            "slurm",
            "--out",
            str(out),
            "--source",
            str(corpus / "*.jsonl"),
            "--tokenizer",
            str(gpt2_tokenizer_path),
            "--tasks",
            "3",
            "--workers",
            "2",
            "--slurm-partition",
            "cpu",
            "--slurm-time",
            "02:00:00",
            "--slurm-sbatch-arg",
            "account=proj",
            "--slurm-env-command",
            "source /opt/venv/bin/activate",
        ]
    code = main(command)
    said = capsys.readouterr().out
    assert code == 0 and "3 tasks as SLURM job array 1001" in said and "merge as job 1003" in said
    jobs = {
        int(p.name): ((p / "args").read_text().split("\n"), (p / "script").read_text())
        for p in record.iterdir()
    }
    logs = tmp_path / "dt.logs"
    array_args, array_script = jobs[1]
    assert "#SBATCH --array=0-2%2" in array_script and "#SBATCH --partition=cpu" in array_script
    assert "#SBATCH --time=02:00:00" in array_script and "#SBATCH --account=proj" in array_script
    assert f"#SBATCH --output={logs / 'slurm_logs'}/%A_%a.out" in array_script
    assert f"launch_pickled_pipeline {logs / 'executor.pik'}" in array_script
    assert "source /opt/venv/bin/activate" in array_script
    assert not any(a.startswith("--dependency") for a in array_args)
    merge_args, merge_script = next((a, s) for a, s in jobs.values() if "pilotrun-prepare-merge" in s)
    assert "--dependency=afterok:1001" in merge_args and "#SBATCH --array=0-0" in merge_script
    assert f"launch_pickled_pipeline {logs / 'merge' / 'executor.pik'}" in merge_script
    assert (logs / "executor.pik").is_file() and json.loads((logs / "ranks_to_run.json").read_text()) == [
        0,
        1,
        2,
    ]
    assert not out.exists() and (tmp_path / "dt.partial" / "input_files.txt").is_file()
    # the same --out with other inputs is refused, and the staging folder is left as it was, bytes and times
    staged, submitted = tree_state(tmp_path / "dt.partial"), sorted(record.iterdir())
    other = [*command[:command.index("--tasks") + 1], "2", *command[command.index("--tasks") + 2:]]
    assert main(other) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds an interrupted prepare of other inputs" in err[0], err
    assert tree_state(tmp_path / "dt.partial") == staged and sorted(record.iterdir()) == submitted


@pytest.mark.slow
def test_local_executor_gives_the_same_bytes_for_any_workers_and_the_folder_trains(corpus, tmp_path,
                                                                                   gpt2_tokenizer_path):
    one = _prepare(corpus, tmp_path / "w1", gpt2_tokenizer_path, tasks=3, workers=1)
    two = _prepare(corpus, tmp_path / "w2", gpt2_tokenizer_path, tasks=3, workers=2)
    assert (tmp_path / "w1" / "metadata.json").read_bytes() == (
        tmp_path / "w2" / "metadata.json"
    ).read_bytes()
    for shard in two["splits"]["train"]["shards"] + two["splits"]["val"]["shards"]:
        assert (tmp_path / "w1" / shard["file"]).read_bytes() == (
            tmp_path / "w2" / shard["file"]
        ).read_bytes()
    assert metadata_sha256(one) == metadata_sha256(two) and verify_data(tmp_path / "w2") == []
    from tests.data.test_data_fits_recipe import train_argv

    run = tmp_path / "run"
    assert main(train_argv(tmp_path / "w2", run)) == 0
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(e["event"] == "train" and e["step"] == 2 for e in events)


def test_slurm_options_default_to_datatrove_s_own():
    options = SlurmOptions(partition="cpu")
    assert (options.cpus_per_task, options.mem_per_cpu_gb, options.max_array_size) == (1, 2, 1001)
