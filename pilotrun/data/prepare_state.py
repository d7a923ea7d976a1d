"""An interruptible prepare: its visible partial folder, the progress file that commits its shards, its stops.

A prepare of `--out DIR` builds `DIR.partial/` (visible, named after its target) and renames it to `DIR` only
when complete. Completed shards are committed as the trainer commits checkpoints: the shard is written and
fsynced, each split's unfinished shard is persisted (shards.ShardWriter.persist), and `progress.json` is
written last, atomically (temp + fsync + rename): a crash at any moment leaves the last recorded state, never
half of one. The record holds what the folder was started with (`request`: source identity, tokenizer spec,
options, software; the resolved tokenizer's identity) and the state at a chunk boundary: documents of the
shuffled stream already written, per-split counts, shards and pending tokens, and the order-correlation sums.
A rerun of the same command replays the source and the seeded shuffle up to that document count without
tokenizing (the buffer is rebuilt deterministically), so its output is byte-identical to an uninterrupted
prepare; a rerun with anything else is refused with the differences named.

The folder is held with an exclusive `flock` on the folder itself (it survives the final rename and needs no
extra file), so two prepares of the same `--out` never write into one folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from typing import Any

from pilotrun.common import stop_signals
from pilotrun.common.errors import DataError, PilotrunError
from pilotrun.common.files import fsync_directory, write_bytes_atomic, write_text_atomic
from pilotrun.common.parsing import read_json_file
from pilotrun.data.shard_hashing import hash_file

PROGRESS_FILE = "progress.json"
PROGRESS_FORMAT = "pilotrun-prepare-progress/1"
PARTIAL_SUFFIX = ".partial"
# written first into a partial folder prepare makes; not in the finished folder
OWN_MARK = "prepare.partial.json"


class PrepareInterrupted(PilotrunError):
    """A stop signal: the state so far is committed in the partial folder; exit 128 + its number."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = stop_signals.exit_code_of(signum)


def differences(recorded: Any, current: Any, where: str = "") -> list[str]:
    """Each leaf that differs, as `key: now X, recorded Y` (dotted keys), in sorted key order."""
    if isinstance(recorded, dict) and isinstance(current, dict):
        found = []
        for key in sorted(set(recorded) | set(current), key=str):
            name = f"{where}.{key}" if where else str(key)
            found += differences(recorded.get(key), current.get(key), name)
        return found
    if recorded == current:
        return []
    return [f"{where or 'value'}: now {json.dumps(current)}, recorded {json.dumps(recorded)}"]


class PartialFolder:
    """`<out>.partial`: created or reopened, locked, committed to, and finally renamed to `out`."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.path = out + PARTIAL_SUFFIX
        self.created = False
        self.committed = False  # this prepare committed progress (after which a stop is not a refusal)
        self._lock: int | None = None
        # The mark's bytes (None: there was none) and the mark's and folder's (atime, mtime) before this
        # prepare wrote itself in as the holder: a refused rerun puts them back (put_back_untouched).
        self._found: tuple[bytes | None, tuple[tuple[int, int], ...]] | None = None

    def open(self, wait_seconds: float = 2.0) -> dict[str, Any] | None:
        """Create (or lock the existing) folder; returns its progress record, None when there is none yet.

        `wait_seconds`: how long a refused prepare waits for the holder to write its name into the mark."""
        if os.path.islink(self.path) or (os.path.lexists(self.path) and not os.path.isdir(self.path)):
            raise DataError(f"{self.path} is in the way (not a folder of an interrupted prepare): remove it")
        if not os.path.isdir(self.path):
            os.makedirs(self.path)
            self.created = True
            # Prepare's own mark, before anything else goes in: a folder of this name without it (and without
            # a progress file) is someone else's, and is never emptied or written into.
            write_text_atomic(
                os.path.join(self.path, OWN_MARK),
                json.dumps({"format": PROGRESS_FORMAT, "out": os.path.basename(self.out)}) + "\n",
            )
        elif not os.path.lexists(os.path.join(self.path, PROGRESS_FILE)) and not self._marked():
            raise DataError(
                f"{self.path} exists but is not the folder of an interrupted pilotrun prepare (it has "
                f"neither {PROGRESS_FILE} nor {OWN_MARK}): not touching it; move it away or choose "
                "another --out"
            )
        self._lock = os.open(self.path, os.O_RDONLY)
        try:
            import fcntl

            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # no flock on this platform: the folder is not guarded against a second prepare
            pass
        except BlockingIOError:
            self.close()
            holder = self._holder_named(wait_seconds)
            who = f" (pid {holder.get('pid')} on host {holder.get('host')})" if holder else ""
            raise DataError(
                f"{self.path} is held by another pilotrun prepare still running{who}; wait for it or "
                "stop it first"
            ) from None
        # finished and renamed by the holder meanwhile
        if os.stat(self.path).st_ino != os.fstat(self._lock).st_ino:
            self.close()
            raise DataError(
                f"{self.path}: another pilotrun prepare of --out {self.out} finished while this one "
                "waited for its folder; nothing was written"
            )
        # The holder, for a second prepare of the same --out to name (the lock itself is the flock above).
        if not self.created:
            self._found = self._as_found()
        write_text_atomic(os.path.join(self.path, OWN_MARK), json.dumps({
            "format": PROGRESS_FORMAT, "out": os.path.basename(self.out),
            "holder": {"pid": os.getpid(), "host": socket.gethostname()}}) + "\n")
        progress = self.read_progress()
        if progress is None and not self.created:
            # An attempt stopped before its first commit: nothing in the folder is recorded, so nothing is
            # kept but the mark that makes it prepare's.
            for entry in os.listdir(self.path):
                if entry != OWN_MARK:
                    _remove(os.path.join(self.path, entry))
        return progress

    def _as_found(self) -> tuple[bytes | None, tuple[tuple[int, int], ...]] | None:
        mark = os.path.join(self.path, OWN_MARK)
        try:
            text = open(mark, "rb").read() if os.path.isfile(mark) and not os.path.islink(mark) else None
            paths = [self.path] + ([mark] if text is not None else [])
            stats = [os.stat(path, follow_symlinks=False) for path in paths]
        except OSError:
            return None
        return text, tuple((s.st_atime_ns, s.st_mtime_ns) for s in stats)

    def put_back_untouched(self) -> None:
        """A rerun refused before it committed anything (other inputs, a changed shard): its holder mark goes
        and the one it found comes back with its times and the folder's, so a refused command leaves the
        partial folder as it found it, bytes and times."""
        if self.created or self.committed or self._found is None:
            return
        text, times = self._found
        mark = os.path.join(self.path, OWN_MARK)
        try:
            if text is None:
                os.remove(mark)
            else:
                write_bytes_atomic(mark, text)
                os.utime(mark, ns=times[1], follow_symlinks=False)
            os.utime(self.path, ns=times[0], follow_symlinks=False)
        except OSError:
            pass  # the refusal is what the user needs to read; a time left new is not worth hiding it for

    def _holder_named(self, wait_seconds: float) -> dict[str, Any]:
        """The holder the mark names, waiting up to `wait_seconds` for it: the holder writes its name just
        after taking the lock, so a prepare refused in between would otherwise name nobody."""
        deadline = time.monotonic() + wait_seconds
        while True:
            holder = self._mark().get("holder") or {}
            if holder or time.monotonic() >= deadline or not os.path.isdir(self.path):
                return holder
            time.sleep(0.02)

    def _mark(self) -> dict[str, Any]:
        """Prepare's own mark in the folder ({} where there is none, or another's)."""
        try:
            mark = read_json_file(os.path.join(self.path, OWN_MARK), OWN_MARK, DataError)
        except DataError:
            return {}
        return mark if isinstance(mark, dict) and mark.get("format") == PROGRESS_FORMAT else {}

    def _marked(self) -> bool:
        """Whether the folder carries prepare's own mark, made for this --out."""
        return self._mark().get("out") == os.path.basename(self.out)

    def read_progress(self) -> dict[str, Any] | None:
        path = os.path.join(self.path, PROGRESS_FILE)
        if not os.path.lexists(path):
            return None
        try:  # the bounded reader: depth and size limited, one line on damage
            record = read_json_file(path, path, DataError)
        except DataError as exc:
            raise DataError(f"{exc}: remove {self.path} to start over") from None
        if not isinstance(record, dict) or record.get("format") != PROGRESS_FORMAT:
            raise DataError(f"{path} is not a progress file of this pilotrun (expected format "
                            f"'{PROGRESS_FORMAT}'): remove {self.path} to start over")
        return record

    def refuse_changes(self, recorded: dict[str, Any], current: dict[str, Any]) -> None:
        found = differences(recorded, current)
        if found:
            raise DataError(
                f"{self.path} holds an interrupted prepare of other inputs ({'; '.join(found)}): run "
                f"the command it was started with to continue it, or remove {self.path} to start over"
            )

    def refuse_changed_shards(self, state: dict[str, Any] | None, splits: tuple[str, ...]) -> None:
        """Every shard the progress file committed, rehashed against the sha256 it committed, before anything
        is added: a shard swapped for another or with a byte flipped would otherwise be listed in the manifest
        under a hash it does not have. One changed or missing is refused by name: what changed it is not
        prepare's to guess, and the files are left as they are."""
        for split in splits:
            for shard in ((state or {}).get("splits") or {}).get(split, {}).get("shards") or []:
                path = os.path.join(self.path, str(shard.get("file")))
                digest = hash_file(path)[0] if os.path.isfile(path) and not os.path.islink(path) else None
                if digest != shard.get("sha256"):
                    what = (
                        "is missing"
                        if digest is None
                        else (
                            f"has sha256 {digest[:16]}..., not the "
                            f"{str(shard.get('sha256'))[:16]}... committed"
                        )
                    )
                    raise DataError(f"{path}: a committed shard of this interrupted prepare {what}: it was "
                                    f"changed after it was written; remove {self.path} to start over")

    def commit(self, record: dict[str, Any], obsolete: list[str] = ()) -> None:
        """Record `record` as the progress (written last, atomically), then delete files it no longer
        needs."""
        self.committed = True
        write_text_atomic(os.path.join(self.path, PROGRESS_FILE),
                          json.dumps({"format": PROGRESS_FORMAT, **record}, sort_keys=True, indent=1) + "\n")
        for path in obsolete:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def keep_only(self, names: set[str]) -> None:
        """Before the rename: remove what the finished folder must not hold (pending files, a shard written
        after the last commit by a killed attempt, temporary files)."""
        for entry in os.listdir(self.path):
            if entry not in names and entry != PROGRESS_FILE:
                _remove(os.path.join(self.path, entry))

    def finish(self, force: bool) -> None:
        """Rename the finished folder to `out` (an old one, with --force, is removed only afterwards), then
        drop the progress file: a kill between the two leaves a complete folder with one extra file."""
        replaced = None
        if os.path.lexists(self.out):
            if not force:
                raise DataError(f"{self.out} appeared while preparing: not replacing it without --force")
            replaced = self.out + REPLACED_SUFFIX  # visible, and put back by recover_replaced after a kill
            _remove(replaced)
            os.rename(self.out, replaced)
        os.rename(self.path, self.out)
        fsync_directory(os.path.dirname(os.path.abspath(self.out)))
        for name in (PROGRESS_FILE, OWN_MARK):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.out, name))
        if replaced is not None:
            _remove(replaced)

    @staticmethod
    def recover_replaced(out: str, force: bool = False) -> list[str]:
        return recover_replaced(out, force)

    def discard(self) -> None:
        _remove(self.path)

    def close(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


REPLACED_SUFFIX = PARTIAL_SUFFIX + ".replaced"


def recover_replaced(out: str, force: bool = False) -> list[str]:
    """What a `prepare --force` killed between its two renames left: the old folder as `OUT.partial.replaced`.
    With no `out` it is put back (the old data is never lost to a kill); beside a finished `out` it is the
    stale old copy and is removed. With `force` over an existing `out`, where the old folder will be during
    the swap. One line each, for the command to print."""
    replaced = out + REPLACED_SUFFIX
    if not os.path.isdir(replaced) or os.path.islink(replaced):
        if force and os.path.isdir(out):
            return [
                f"--force: {out} stays whole until the new folder is complete, then moves to {replaced} for "
                "the swap (put back by the next prepare if this one is killed there)"
            ]
        return []
    if not os.path.lexists(out):
        os.rename(replaced, out)
        fsync_directory(os.path.dirname(os.path.abspath(out)))
        return [f"restored {out} from {replaced}: a prepare --force was interrupted while replacing it"]
    _remove(replaced)
    return [f"removed {replaced}: the old copy an interrupted prepare --force left beside the finished {out}"]


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


class StopRequests:
    """A stop signal (pilotrun/common/stop_signals.py) asks prepare to stop at the next chunk boundary, after
    committing its state; a second one stops at once (KeyboardInterrupt: the last committed state is still
    there to continue from)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequests]:
        with stop_signals.handling(self._handle):
            yield self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return stop_signals.exit_code_of(self.signum) if self.signum is not None else 0


def peak_resident_mb() -> float:
    """This process's peak resident set (VmHWM on Linux: unlike ru_maxrss it does not carry a parent's peak
    across exec), in MiB."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, kilobytes elsewhere
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024.0
