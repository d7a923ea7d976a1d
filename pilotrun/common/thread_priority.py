"""Work that runs beside training yields the CPU to it: the calling thread's nice value is raised.

On Linux every thread has its own nice value (the scheduler weighs threads of one process against each other
by it), and a thread starts with the nice value of the thread that created it. A background checkpoint's
writer calls `yield_to_training()` first, so that it and the threads it starts (DCP's file writers, the
hashing) take the CPU the training threads leave: on a machine where the training keeps every core busy
(a CPU-only run) the write stretches instead of the training slowing down; where a core is free (a GPU run,
whose loop mostly waits for the device) the write runs at full speed. Raising one's own nice value needs no
privilege; it can never be lowered again, so it is only ever done to threads started for the background
work. Elsewhere (no per-thread nice values) it does nothing.
"""

from __future__ import annotations

import os
import sys
import threading

BACKGROUND_NICENESS = 10  # above the process's own: about a tenth of a core's time against a busy thread


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
