"""Environment facts: git state of a real repository, device peaks only for known devices, memory."""

import os
import subprocess

import pytest
import torch

from pilotrun.training.environment import (
    device_peak_flops,
    git_state,
    hardware_info,
    match_device_peak,
    memory_snapshot,
    software_versions,
)


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_git_state_tracks_commit_dirty_and_diff_hash(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "commit", "-q", "-m", "one")
    clean = git_state(repo, paths=(".",))
    assert len(clean["commit"]) == 40 and clean["dirty"] is False
    (repo / "a.py").write_text("x = 2\n")
    dirty = git_state(repo, paths=(".",))
    assert dirty["commit"] == clean["commit"] and dirty["dirty"] is True
    assert dirty["diff_sha256"] != clean["diff_sha256"]
    (repo / "a.py").write_text("x = 3\n")
    # a different edit, a different hash
    assert git_state(repo, paths=(".",))["diff_sha256"] != dirty["diff_sha256"]
    (repo / "a.py").write_text("x = 1\n")
    (repo / "new.py").write_text("")
    untracked = git_state(repo, paths=(".",))
    assert untracked["dirty"] is True and untracked["diff_sha256"] != clean["diff_sha256"]


@pytest.mark.slow
def test_outputs_outside_the_package_leave_the_code_clean(tmp_path):
    """A lock or an export written into the checkout's root is not code; an edit inside the package is."""
    repo = tmp_path / "repo"
    (repo / "pilotrun").mkdir(parents=True)
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    (repo / "pilotrun" / "m.py").write_text("x = 1\n")
    (repo / "README.md").write_text("read me\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    clean = git_state(repo)
    (repo / "recipe.lock.json").write_text("{}")
    (repo / "hf").mkdir()
    (repo / "hf" / "model.safetensors").write_bytes(b"x")
    (repo / "README.md").write_text("edited\n")
    assert git_state(repo) == clean and clean["dirty"] is False
    (repo / "pilotrun" / "new.py").write_text("")
    assert git_state(repo)["dirty"] is True


def test_git_state_outside_a_repository_is_none(tmp_path):
    assert git_state(tmp_path) == {"commit": None, "dirty": None, "diff_sha256": None}


def test_device_peaks_match_only_known_names():
    assert match_device_peak("NVIDIA H100 80GB HBM3") == "NVIDIA H100 SXM"
    assert match_device_peak("NVIDIA H100 PCIe") == "NVIDIA H100 PCIe"
    assert match_device_peak("NVIDIA H100 NVL") is None
    assert match_device_peak("NVIDIA A100-SXM4-80GB") == "NVIDIA A100"
    assert match_device_peak("NVIDIA A10G") is None  # not an A10
    assert match_device_peak("NVIDIA A10") == "NVIDIA A10"
    assert match_device_peak("NVIDIA H200") == "NVIDIA H200"
    peak, basis = device_peak_flops("NVIDIA A100-SXM4-40GB", "bf16")
    assert peak == 312e12 and "A100" in basis
    assert device_peak_flops("NVIDIA A100-SXM4-40GB", "fp32")[0] == 19.5e12
    assert device_peak_flops("NVIDIA A100-SXM4-40GB", "fp32", tf32_enabled=True)[0] == 156e12
    assert device_peak_flops("Tesla V100-SXM2-16GB", "bf16")[0] is None  # no bf16 on V100
    assert device_peak_flops("Some Future GPU", "bf16")[0] is None


def test_cpu_hardware_has_no_peak():
    info = hardware_info(torch.device("cpu"), world_size=1, precision="fp32")
    assert info["world_size"] == 1 and info["device"] == "cpu" and info["cpu_count"] >= 1
    assert info["peak_flops_per_s"] is None and "CPU" in info["peak_basis"]


def test_software_and_memory():
    versions = software_versions()
    assert versions["torch"] == torch.__version__ and versions["pilotrun"]
    memory = memory_snapshot(torch.device("cpu"))
    assert memory["rss_mb"] > 1 and memory["peak_rss_mb"] >= memory["rss_mb"] * 0.5
    assert memory["cuda_max_allocated_mb"] is None


def test_the_default_thread_count_divides_the_physical_cores_among_the_local_ranks(monkeypatch):
    from pilotrun.training import environment

    assert 1 <= environment.physical_cores() <= (os.cpu_count() or 1)
    monkeypatch.setattr(environment, "physical_cores", lambda: 8)
    assert [environment.default_threads(n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
