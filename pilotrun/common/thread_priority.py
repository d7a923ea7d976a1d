"""Work that runs beside training yields the CPU to it: the calling thread's nice value is raised to the
lowest priority a thread of normal scheduling can have.

On Linux every thread has its own nice value, and a thread starts with the nice value of the thread that
created it. A background checkpoint's writer calls `yield_to_training()` first, so that it and the threads it
starts (DCP's file writers, the hashing) take the CPU the training threads leave.

Why the lowest priority and not merely a lower one: the scheduler shares the CPU between scheduling groups (a
session's autogroup, a job's cgroup) first and between the threads of one group second, by their weights. The
writer is a thread of the training's own process, so on a busy machine (a CPU-only run, or cores shared with
other jobs) every CPU-second it gets is taken from the group's share, that is from the training loop, in the
ratio of their weights. Measured beside a one-thread training on 2 loaded cores (BENCHMARKS.md, "Background
checkpoints"): at nice 10 (weight 110 against the loop's 1024, per writer thread) the loop kept 61-91% of its
steady rate in rounds before and after a write and 83% in paired windows; at nice 19 (weight 15) 93-95%. Its
CPU time per update did not change (memory bandwidth is not the cost) and its waits for the GIL stayed under
1.5 ms per update: what it lost was time waiting on the run queue. Where nothing trains beside the write (a
loop waiting for it, or a GPU run whose loop mostly waits for the device) the writer is alone in its group and
runs at the group's full share whatever its nice value, so the write itself is not slowed there. SCHED_IDLE
would yield even more but starves the write outright on a loaded machine (a 3-second write still running after
170 s). Raising one's own nice value needs no privilege; it can never be lowered again, so it is only ever
done to threads started for the background work. Elsewhere (no per-thread nice values) it does nothing.
"""

from __future__ import annotations

import os
import sys
import threading

BACKGROUND_NICENESS = 19  # above the process's own, capped at 19: the lowest normal priority


def yield_to_training(niceness: int = BACKGROUND_NICENESS) -> int | None:
    """Raise this thread's nice value to the process's plus `niceness` (at most 19); returns the value it
    now has, or None where threads have no nice value of their own (only Linux has)."""
    if not sys.platform.startswith("linux"):
        return None
    thread = threading.get_native_id()
    try:
        target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + niceness)
        if os.getpriority(os.PRIO_PROCESS, thread) < target:
            os.setpriority(os.PRIO_PROCESS, thread, target)
        return os.getpriority(os.PRIO_PROCESS, thread)
    except OSError:  # a sandbox that refuses it: the write runs at the training's priority, as before
        return None
