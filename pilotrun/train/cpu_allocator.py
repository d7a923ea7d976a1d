"""Keep glibc's malloc from handing activation-sized blocks back to the kernel between training steps.

A CPU training step allocates and frees many tensors of a few hundred kB to a few MB. With glibc's default
settings, blocks above the mmap threshold (128 kB, raised dynamically) are mmap'ed and unmapped one by one, and
free memory at the top of the heap is returned to the kernel once it exceeds the trim threshold; every step
then touches fresh pages again, and each first touch is a page fault. On the 2-core VM this project is
developed on, that made elementwise ops on [1024, 128] fp32 tensors run several times slower than on reused
memory, and a whole `cpu`-preset training step 11-16% slower (paired in one process,
`python -m benchmarks.run_all bench_model`, BENCHMARKS.md). PyTorch's CPU performance guide makes the same
observation and suggests swapping in jemalloc or tcmalloc with LD_PRELOAD; `mallopt` gets the effect without
a second allocator or a change to how the process is launched.

The settings: mmap threshold 32 MiB (glibc's largest allowed value on 64-bit; blocks below it come from the
heap and are reused) and trim threshold 1 GiB (free heap memory is kept for the next step). The cost is that
memory freed at the end of training is not returned to the kernel before the process exits. Set
PILOTRUN_CPU_ALLOCATOR=default to leave malloc alone (for an A/B comparison, or a memory-tight host). The
outcome is recorded in run.json (`hardware.cpu_allocator`), so a session's speed can be read with it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from typing import Any

# mallopt parameter numbers from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit; larger values are refused
TRIM_THRESHOLD_BYTES = 2**30
OPT_OUT_VARIABLE = "PILOTRUN_CPU_ALLOCATOR"


def load_glibc() -> Any | None:
    """The C library if it is glibc (it has `mallopt` and `gnu_get_libc_version`), else None."""
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return None  # musl and other C libraries
    return libc


def tune_cpu_allocator(libc_loader=load_glibc) -> dict[str, Any]:
    """Apply the settings above to this process's malloc; returns what was done, for run.json."""
    if os.environ.get(OPT_OUT_VARIABLE, "").strip().lower() == "default":
        return {"tuned": False, "reason": f"{OPT_OUT_VARIABLE}=default"}
    libc = libc_loader()
    if libc is None:
        return {"tuned": False, "reason": "not glibc on Linux: malloc left as it is"}
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    version = libc.gnu_get_libc_version().decode()
    mmap_ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    trim_ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not (mmap_ok and trim_ok):
        return {"tuned": False, "reason": f"glibc {version} refused mallopt (mmap_threshold accepted: {mmap_ok}, "
                                          f"trim_threshold accepted: {trim_ok})", "glibc": version}
    return {"tuned": True, "glibc": version, "mmap_threshold_bytes": MMAP_THRESHOLD_BYTES,
            "trim_threshold_bytes": TRIM_THRESHOLD_BYTES}
