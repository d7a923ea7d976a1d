"""The pilot's kill point: a training process that stops itself at a known step, so the pilot's SIGKILL lands there.

`pilotrun pilot` proves that a run continues exactly after a real, unannounced SIGKILL. It used to kill once
metrics.jsonl showed a step past the midpoint and a committed checkpoint, but the training process does not
wait for the pilot to read the file: with updates of a few milliseconds (a small recipe, any recipe on a GPU)
it could commit its final checkpoint before the kill landed, and the resumed session then had nothing left to
do, so the verdict rightly said the pilot never proved it can continue.

So the pilot names the step in an environment variable and the trainer, once it has logged a `train` event past
that step and committed a checkpoint in this session (and before its last update), flushes its output and sends
itself SIGSTOP. The pilot sees the stopped state and sends SIGKILL: the process still dies without any handler,
atexit or final checkpoint, exactly as before; only the moment is no longer a race. A stopped process that is
sent SIGCONT instead (someone found it by hand) just carries on. Single-process runs only: under torchrun the
variable is ignored, since one rank stopping alone would leave the others waiting in a collective.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from pilotrun.errors import ConfigError

FREEZE_PAST_STEP_ENV = "PILOTRUN_PILOT_FREEZE_PAST_STEP"


class FreezePoint:
    """When the trainer stops itself for the pilot: `due` after each update, `freeze` once."""

    def __init__(self, past_step: int | None) -> None:
        self.past_step = past_step

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ, *, distributed: bool = False) -> FreezePoint:
        text = environ.get(FREEZE_PAST_STEP_ENV, "").strip()
        if not text or distributed:
            return cls(None)
        try:
            step = int(text)
        except ValueError:
            raise ConfigError(f"{FREEZE_PAST_STEP_ENV}={text!r}: must be a whole number of updates (the pilot "
                              "sets it for its first training process; unset it to train normally)") from None
        return cls(step)

    def due(self, logged_step: int | None, checkpoint_committed: bool, step: int, max_steps: int) -> bool:
        """A train event past the step is logged, a checkpoint of this session is committed, updates remain."""
        return (self.past_step is not None and logged_step is not None and logged_step > self.past_step
                and checkpoint_committed and step < max_steps)

    def freeze(self) -> None:
        self.past_step = None  # once: a process continued with SIGCONT trains to the end
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSTOP)


def wait_until_stopped(pid: int, timeout_seconds: float, poll_seconds: float = 0.005) -> bool:
    """Whether process `pid` reached the stopped state ('T' in /proc/PID/stat) within the timeout. False at once
    where /proc is missing (not Linux) or the process has gone: the caller then kills without waiting."""
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            # The state follows the command name in parentheses, which may itself hold spaces or parentheses.
            state = stat.read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            return False
        if state in ("T", "t"):
            return True
        if state in ("Z", "X") or time.monotonic() >= deadline:
            return False
        time.sleep(poll_seconds)
