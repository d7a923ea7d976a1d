"""The prepared GPU check script (benchmarks/device_check.py) runs end to end on the CPU with small shapes, so
it is known to work before a session spends its few GPU minutes on it."""

import json

import pytest

from benchmarks.device_check import main


@pytest.mark.slow
def test_device_check_dry_run_completes_every_section(tmp_path, capsys):
    # No time budget here: on a busy machine the sections take longer, and a budget would skip some of them.
    assert main(["--out", str(tmp_path), "--cpu-dry-run", "--budget-s", "inf"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results) == ["environment", "moe_layer", "attention", "model_step", "model_step_recompute",
                             "model_step_compiled", "pilot"]
    assert all(result["status"] == "ok" for result in results.values()), results
    assert results["attention"]["tracked_max_logit_equal"] is True
    assert results["model_step_recompute"]["activation_checkpointing"] is True
    assert results["pilot"]["record_valid"].startswith("PASS") and results["pilot"]["resumed"].startswith(
        "PASS"
    )
    windows = results["pilot"]["windows_with_device_seconds"]  # CUDA timing events: none on the CPU
    assert windows.startswith("0 of ") and int(windows.split(" of ")[1]) > 0
    assert (tmp_path / "results.md").read_text().startswith("# device_check results")
