"""pilotrun/train/cpu_allocator.py: the malloc settings take effect on glibc, are skipped with a reason elsewhere,
and reach run.json."""

from __future__ import annotations

import ctypes
import json
import platform
from pathlib import Path

import pytest
import torch

from pilotrun.train import cpu_allocator
from pilotrun.train.cpu_allocator import MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES, tune_cpu_allocator

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
on_glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="needs glibc on Linux")


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def mmapped_and_heap_bytes() -> tuple[int, int]:
    libc = cpu_allocator.load_glibc()
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc older than 2.33 has no mallinfo2")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.hblkhd, info.uordblks


@on_glibc
def test_tuning_reports_the_settings_and_a_4_mib_tensor_then_comes_from_the_heap(monkeypatch):
    monkeypatch.delenv(cpu_allocator.OPT_OUT_VARIABLE, raising=False)
    result = tune_cpu_allocator()
    assert result == {"tuned": True, "glibc": platform.libc_ver()[1], "mmap_threshold_bytes": MMAP_THRESHOLD_BYTES,
                      "trim_threshold_bytes": TRIM_THRESHOLD_BYTES}
    mmapped_before, heap_before = mmapped_and_heap_bytes()
    tensor = torch.empty(2**20, dtype=torch.float32)  # 4 MiB: mmap'ed under glibc's default 128 kB threshold
    mmapped_after, heap_after = mmapped_and_heap_bytes()
    assert mmapped_after == mmapped_before
    assert heap_after - heap_before >= tensor.numel() * tensor.element_size()
    del tensor


def test_opt_out_variable_leaves_malloc_alone_without_loading_libc(monkeypatch):
    monkeypatch.setenv(cpu_allocator.OPT_OUT_VARIABLE, "default")

    def must_not_load():
        raise AssertionError("libc loaded although the opt-out variable is set")

    assert tune_cpu_allocator(must_not_load) == {"tuned": False, "reason": "PILOTRUN_CPU_ALLOCATOR=default"}


def test_a_c_library_that_is_not_glibc_is_reported(monkeypatch):
    monkeypatch.delenv(cpu_allocator.OPT_OUT_VARIABLE, raising=False)
    result = tune_cpu_allocator(lambda: None)
    assert result["tuned"] is False and "not glibc" in result["reason"]


def test_a_refused_mallopt_is_reported_not_claimed(monkeypatch):
    monkeypatch.delenv(cpu_allocator.OPT_OUT_VARIABLE, raising=False)

    class RefusingLibc:
        def __init__(self):
            self.gnu_get_libc_version = lambda: b"2.99"

        @staticmethod
        def mallopt(parameter, value):
            return 0 if parameter == cpu_allocator.M_MMAP_THRESHOLD else 1

    result = tune_cpu_allocator(RefusingLibc)
    assert result["tuned"] is False
    assert "mmap_threshold accepted: False" in result["reason"] and "trim_threshold accepted: True" in result["reason"]


def test_the_trainer_records_the_outcome_in_run_json(tmp_path, builtin_data_dir, monkeypatch):
    from pilotrun.cli import main

    monkeypatch.setenv(cpu_allocator.OPT_OUT_VARIABLE, "default")
    run_dir = tmp_path / "run"
    assert main(["train", "--config", str(SMOKE), "--data", str(builtin_data_dir), "--run-dir",
                 str(run_dir), "--set", "train.max_steps=1", "--set", "train.num_threads=1"]) == 0
    record = json.loads((run_dir / "run.json").read_text())
    assert record["sessions"][-1]["hardware"]["cpu_allocator"] == {
        "tuned": False, "reason": "PILOTRUN_CPU_ALLOCATOR=default"}
