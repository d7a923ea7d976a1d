"""Where and with what a session ran: git state, hardware, software versions, memory, and device peaks.

run.json records these per session so that two sessions of one run can be compared (same code? same
machine?) and so that MFU is computed only against a published peak for the named device. The peak table
holds dense (no structured sparsity) figures from NVIDIA's data sheets; a device that is not in it, or
a CPU, gets MFU "unknown" and the achieved FLOP/s alone (no figure without a basis).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from pilotrun.version import __version__

# Dense peak FLOP/s per device by compute precision. "fp32" is the non-tensor-core FP32 rate (PyTorch's
# default for float32 matmuls, `allow_tf32=False`); "tf32" applies when TF32 matmuls are switched on. Sources
# (NVIDIA data sheets; the sparsity figures there are twice these): A100 80GB data sheet (2021); H100 Tensor
# Core GPU data sheet (SXM and PCIe columns); H200 data sheet (same compute as H100 SXM); V100 data sheet
# (SXM2); L4 and L40S data sheets; A10 data sheet; T4 data sheet.
TERA = 1e12
DEVICE_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "NVIDIA A100": {"fp32": 19.5 * TERA, "tf32": 156 * TERA, "bf16": 312 * TERA, "fp16": 312 * TERA},
    "NVIDIA H100 SXM": {"fp32": 67 * TERA, "tf32": 494.7 * TERA, "bf16": 989.4 * TERA, "fp16": 989.4 * TERA},
    "NVIDIA H100 PCIe": {"fp32": 51 * TERA, "tf32": 378 * TERA, "bf16": 756 * TERA, "fp16": 756 * TERA},
    "NVIDIA H200": {"fp32": 67 * TERA, "tf32": 494.7 * TERA, "bf16": 989.4 * TERA, "fp16": 989.4 * TERA},
    "NVIDIA V100 SXM2": {"fp32": 15.7 * TERA, "fp16": 125 * TERA},
    "NVIDIA L4": {"fp32": 30.3 * TERA, "tf32": 60 * TERA, "bf16": 121 * TERA, "fp16": 121 * TERA},
    "NVIDIA L40S": {"fp32": 91.6 * TERA, "tf32": 183 * TERA, "bf16": 362 * TERA, "fp16": 362 * TERA},
    "NVIDIA A10": {"fp32": 31.2 * TERA, "tf32": 62.5 * TERA, "bf16": 125 * TERA, "fp16": 125 * TERA},
    "NVIDIA T4": {"fp32": 8.1 * TERA, "fp16": 65 * TERA},
}

# torch.cuda.get_device_name() strings -> table keys. Order matters (H100 PCIe/NVL before plain H100); names
# that only look alike (A10G, A100 vs A10, H100 NVL) must not borrow another device's peak.
_DEVICE_PATTERNS: list[tuple[str, str | None]] = [
    (r"\bH200\b", "NVIDIA H200"),
    (r"\bH100\b.*\bNVL\b", None),
    (r"\bH100\b.*\bPCIe\b", "NVIDIA H100 PCIe"),
    (r"\bH100\b", "NVIDIA H100 SXM"),
    (r"\bA100\b", "NVIDIA A100"),
    (r"\bV100\b.*\bSXM2\b", "NVIDIA V100 SXM2"),
    (r"\bL40S\b", "NVIDIA L40S"),
    (r"\bL4\b", "NVIDIA L4"),
    (r"\bA10\b(?!G)", "NVIDIA A10"),
    (r"\bT4\b", "NVIDIA T4"),
]


def match_device_peak(device_name: str) -> str | None:
    """The peak-table key for a device name, or None when the device is not (unambiguously) known."""
    for pattern, key in _DEVICE_PATTERNS:
        if re.search(pattern, device_name):
            return key
    return None


def device_peak_flops(
    device_name: str, precision: str, tf32_enabled: bool = False
) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, the basis in words); (None, reason) when unknown."""
    key = match_device_peak(device_name)
    if key is None:
        return None, f"no published peak for device '{device_name}'"
    compute = precision
    if precision == "fp32" and tf32_enabled:
        compute = "tf32"
    peak = DEVICE_PEAK_FLOPS[key].get(compute)
    if peak is None:
        return None, f"no published {compute} peak for {key}"
    return peak, f"{key} dense {compute} peak {peak / TERA:g} TFLOP/s (NVIDIA data sheet)"


# The code that runs: the package (its modules, kernels and packaged recipes) and the file that pins what it
# installs. A lock written into the checkout's root, an export folder or an edited README changes none of it,
# so none of them makes the code "dirty".
CODE_PATHS = ("pilotrun", "pyproject.toml")


def git_state(repo_dir: str | Path | None = None, paths: tuple[str, ...] = CODE_PATHS) -> dict[str, Any]:
    """Commit, dirty flag and sha256 of the uncommitted changes of the code that runs (`paths` of the
    checkout).

    The hash covers `git diff HEAD --binary` of those paths plus the names of their untracked, non-ignored
    files, so two sessions with the same commit and hash ran the same code. Outside a git checkout all three
    are None.
    """
    repo_dir = Path(repo_dir) if repo_dir is not None else Path(__file__).resolve().parents[2]

    def git(*args: str) -> bytes | None:
        try:
            result = subprocess.run(["git", "-C", str(repo_dir), *args], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return result.stdout if result.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "diff_sha256": None}
    diff = git("diff", "HEAD", "--binary", "--", *paths) or b""
    untracked = git("ls-files", "--others", "--exclude-standard", "--", *paths) or b""
    dirty = bool(diff.strip() or untracked.strip())
    digest = hashlib.sha256(diff + b"\0untracked\0" + untracked).hexdigest()
    return {"commit": commit.decode().strip(), "dirty": dirty, "diff_sha256": digest}


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def physical_cores() -> int:
    """The physical cores this process may run on (its CPU affinity, hyperthread siblings counted once), from
    /sys where Linux has it; else the logical CPUs."""
    cpus = (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(
                (
                    (topology / "physical_package_id").read_text().strip(),
                    (topology / "core_id").read_text().strip(),
                )
            )
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def default_threads(local_ranks: int) -> int:
    """`train.num_threads: 0`: one intra-op thread per physical core, the cores divided among the ranks of
    this machine (torch's own default counts every logical CPU for every rank: oversubscribed under torchrun,
    and its spinning OpenMP threads lose whole time slices on a machine that also runs other work;
    BENCHMARKS.md, the thread section, has the measurement)."""
    return max(1, physical_cores() // max(1, local_ranks))


def hardware_info(device: torch.device, world_size: int, precision: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "world_size": int(world_size),
        "device": device.type,
        "device_name": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "hostname": platform.node(),
    }
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        info.update(device_name=props.name, device_count=torch.cuda.device_count(),
                    device_memory_mb=props.total_memory / 2**20,
                    compute_capability=f"{props.major}.{props.minor}")
        peak, basis = device_peak_flops(props.name, precision, torch.backends.cuda.matmul.allow_tf32)
    else:
        peak, basis = None, "CPU: no device peak; achieved FLOP/s reported, MFU unknown"
    info["peak_flops_per_s"] = peak  # one device; MFU divides by peak * world_size
    info["peak_basis"] = basis
    return info


def software_versions() -> dict[str, Any]:
    import numpy

    versions: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "pilotrun": __version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }
    for name in ("tokenizers", "yaml"):
        module = sys.modules.get(name)
        if module is None:
            try:
                module = __import__(name)
            except ImportError:
                continue
        versions["pyyaml" if name == "yaml" else name] = getattr(module, "__version__", None)
    return versions


def peak_resident_mb() -> float:
    """This process's peak resident set (MB). On Linux from VmHWM, the high-water mark of the process's own
    address space: `ru_maxrss` survives fork and exec, so a process started by a bigger one (the pilot's
    training child, a benchmark's subprocess) would report its parent's peak."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10  # kB
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, kilobytes elsewhere
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def memory_snapshot(device: torch.device) -> dict[str, float | None]:
    """Current and peak resident memory of this process (MB) and the CUDA allocator's peak, if any."""
    rss_mb = None
    try:
        with open("/proc/self/statm") as f:
            rss_mb = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        pass
    peak_mb = peak_resident_mb()
    cuda_mb = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {"rss_mb": rss_mb, "peak_rss_mb": peak_mb, "cuda_max_allocated_mb": cuda_mb}
