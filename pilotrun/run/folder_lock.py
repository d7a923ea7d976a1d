"""One writer per run folder: an exclusive lock held for the whole training session.

Two `pilotrun train` processes on one run folder would interleave metrics.jsonl and overwrite each other's
run.json, turning a valid record into a permanently invalid one. So a session takes an exclusive
`flock` on RUN/run.lock before it writes anything, and holds it until the session ends. The kernel
releases the lock when the process dies, however it dies (SIGKILL included), so there is never a stale
lock to clean up: the file stays, only the lock goes. The file holds who took it (pid, host, since,
command), so a refused second process can name the holder. Under torchrun rank 0 takes it and tells the
other ranks; they all refuse together.

The file is never deleted while a run folder exists (deleting it would let two processes lock two
different files of the same name); a fresh session refused before writing anything removes the folder it
created, lock file included.

Network filesystems: on Linux, NFS (v3 with lockd, v4) emulates flock with byte-range locks held by the
server, so two clients exclude each other as long as the server's locking works; a mount with `nolock`, or
filesystems that keep flock per client (some FUSE and parallel filesystems, Lustre without `-o flock`),
lock only within one machine, and two machines could then both write. Where the filesystem refuses locks
altogether (ENOLCK, EOPNOTSUPP), the session warns, records a note, and runs unlocked.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from pilotrun.common.errors import PilotrunError

LOCK_NAME = "run.lock"
UNSUPPORTED_ERRNOS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
# A holder writes its line just after it takes the lock, so a process refused in between finds the file empty
# (or just truncated). It re-reads for this long before it gives up on naming the holder: on a loaded machine
# the holder can be descheduled between the two steps for a noticeable time.
HOLDER_LINE_WAIT_SECONDS = 5.0
HOLDER_LINE_POLL_SECONDS = 0.02


class RunFolderBusy(PilotrunError):
    """Another process holds the run folder's lock: exit 2, naming the holder."""


def parse_holder(text: str | bytes) -> dict | None:
    """The holder record of a lock file's first line, or None while it is not (yet) a complete JSON object
    (or the file holds something else: bytes that are not UTF-8, a nesting no parser follows)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    first_line, newline, _ = text.partition("\n")
    if not newline:  # the holder writes one line ending in a newline: without it the write is not finished
        return None
    try:
        holder = json.loads(first_line)
    except (ValueError, RecursionError):
        return None
    return holder if isinstance(holder, dict) else None


def describe_holder(holder: dict | None) -> str:
    """A lock file's holder as 'pid P on host H since T', or that it could not be read."""
    if holder is None:
        return "a process whose details could not be read"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since {holder.get('since', '?')}"


def read_holder(handle: Any) -> dict | None:
    """The lock file's holder once it has written its line, or None after the wait: the holder took the lock
    before writing, so an empty file usually means 'just started', not 'unknown'."""
    deadline = time.monotonic() + HOLDER_LINE_WAIT_SECONDS
    while True:
        handle.seek(0)
        holder = parse_holder(handle.read(4096))
        if holder is not None or time.monotonic() >= deadline:
            return holder
        time.sleep(HOLDER_LINE_POLL_SECONDS)


def _rewrite(handle: Any, text: str | bytes) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(text.encode("utf-8") if isinstance(text, str) else text)
    handle.flush()


def _times(*paths: Path) -> tuple[tuple[int, int], ...] | None:
    """(atime_ns, mtime_ns) of each path (not following a link), or None where one cannot be read."""
    try:
        stats = [os.stat(path, follow_symlinks=False) for path in paths]
    except OSError:
        return None
    return tuple((s.st_atime_ns, s.st_mtime_ns) for s in stats)


def open_lock_file(run_dir: Path, create: bool) -> Any:
    """RUN/run.lock opened without following a symbolic link (binary, read and write; or read-only without
    `create`): a link there would make the session truncate and rewrite whatever file it points to."""
    path = run_dir / LOCK_NAME
    if path.is_symlink():
        raise PilotrunError(
            f"{path}: a symbolic link; refused (pilotrun never writes through a link). Remove "
            "the link; the run folder's lock is a plain file"
        )
    flags = (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY) | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o644)  # a link swapped in after the check fails here (ELOOP)
    return os.fdopen(fd, "r+b" if create else "rb")


def _flock_holders(path: Path) -> set[int] | None:
    """Pids holding a flock on the file `path` per /proc/locks (Linux), or None where it cannot be read."""
    try:
        stat = path.stat()
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    inode = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    holders = set()
    for line in table.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 08:01:1234 0 EOF"; a blocked waiter's line carries "->" first.
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode and fields[4].isdigit():
            holders.add(int(fields[4]))
    return holders


def live_holder(run_dir: str | Path) -> dict | None:
    """Who holds the run folder now, or None when no process does; never takes, creates or changes the lock
    (summarize, verdict and watch read a live run this way). On Linux /proc/locks says whether the file is
    locked; elsewhere the recorded holder counts as alive when its pid runs on this host."""
    path = Path(run_dir) / LOCK_NAME
    if path.is_symlink() or not path.is_file():
        return None
    try:
        with open_lock_file(Path(run_dir), create=False) as handle:
            holder = parse_holder(handle.read(4096))
    except OSError:
        return None
    holders = _flock_holders(path)
    if holders is not None:
        if not holders:
            return None
        return holder if holder is not None else {"pid": min(holders)}
    if holder is None or holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return None
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return None
    except OSError:
        pass  # alive, owned by another user
    return holder


def _remove_empty_folders(folders: list[Path]) -> None:
    """rmdir each of `folders` in order (deepest first) that is still an empty plain folder; others stay."""
    for folder in folders:
        if folder.is_symlink() or not folder.is_dir():
            continue
        try:
            folder.rmdir()
        except OSError:
            # not empty (someone else's file, or another session's): its parents are not ours to remove
            return


def _open_and_lock(run_dir: Path) -> tuple[Any, str | None]:
    """RUN/run.lock opened and locked: (handle, None), or (handle, note) where the filesystem gives no locks;
    RunFolderBusy naming the holder. A lock taken on a file that is no longer RUN/run.lock (a refused session
    removed the lock file it had made, between our open and our lock) is let go and taken again on the current
    file, so two sessions never hold two different files of the same name."""
    for _attempt in range(100):
        handle = open_lock_file(run_dir, create=True)
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = describe_holder(read_holder(handle))
            handle.close()
            raise RunFolderBusy(
                f"run folder {run_dir} is in use by {holder} (it holds {run_dir / LOCK_NAME}); "
                "wait for it to end, or stop it, before training into this folder"
            ) from None
        except OSError as exc:
            if exc.errno not in UNSUPPORTED_ERRNOS:
                handle.close()
                raise
            note = (
                f"the filesystem of {run_dir} does not support file locks ({exc.strerror}): this session "
                "runs unlocked, and a second writer on the same folder would not be refused"
            )
            print(f"warning: {note}", file=sys.stderr, flush=True)
            return handle, note
        try:
            current = os.stat(run_dir / LOCK_NAME, follow_symlinks=False)
        except FileNotFoundError:
            current = None
        mine = os.fstat(handle.fileno())
        if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
            return handle, None
        handle.close()
    raise RunFolderBusy(
        f"run folder {run_dir}: its lock file {run_dir / LOCK_NAME} keeps being replaced; another "
        "process is starting in this folder"
    )


class RunFolderLock:
    """`acquire` takes the lock or raises RunFolderBusy; `release` lets it go (the kernel does so at exit)."""

    def __init__(
        self,
        run_dir: Path,
        handle: Any,
        created_folder: bool,
        note: str | None = None,
        previous_text: bytes = b"",
        *,
        created_parents: tuple[Path, ...] = (),
        created_file: bool = False,
        names_before: frozenset[str] = frozenset(),
        times_before: tuple[tuple[int, int], ...] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self._handle = handle
        self.created_folder = created_folder  # this session made the run folder (a fresh run)
        self.note = note  # set when the filesystem gives no locks
        self.previous_text = previous_text  # the last holder's line, put back if this session is refused
        # What a refused session takes away again: the missing parents of --run-dir it made (deepest first),
        # whether run.lock is its own (a run folder copied without it), and the names the folder held before.
        self.created_parents = created_parents
        self.created_file = created_file
        self.names_before = names_before
        # (atime, mtime) in ns of the run folder and of its lock file (where there was one) before this
        # session wrote there: a refused session puts them back, leaving the folder as it found it.
        self.times_before = times_before

    @property
    def path(self) -> Path:
        return self.run_dir / LOCK_NAME

    @classmethod
    def acquire(cls, run_dir: str | Path) -> RunFolderLock:
        run_dir = Path(run_dir)
        created = not run_dir.exists()
        missing = []  # the folders mkdir makes, deepest first
        folder = run_dir
        while not os.path.lexists(folder) and folder != folder.parent:
            missing.append(folder)
            folder = folder.parent
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            names_before = frozenset(p.name for p in run_dir.iterdir())
        except OSError as exc:
            _remove_empty_folders(missing)
            raise PilotrunError(
                f"run folder {run_dir}: cannot create its lock file ({exc.strerror or exc})"
            ) from None
        created_file = LOCK_NAME not in names_before
        times_before = None if created else _times(run_dir, *([] if created_file else [run_dir / LOCK_NAME]))
        try:
            handle, note = _open_and_lock(run_dir)
        except BaseException:
            # Refused (another holder, a lock file that cannot be made): the parents this attempt made go
            # again when empty. The lock file stays: a holder has it open.
            _remove_empty_folders(missing)
            raise
        lock = cls(
            run_dir,
            handle,
            created,
            note,
            created_parents=tuple(missing[1:]),
            created_file=created_file,
            names_before=names_before,
            times_before=times_before,
        )
        if note is not None:
            return lock
        handle.seek(0)
        lock.previous_text = handle.read(4096)  # bytes: put back as they were if this session is refused
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                  "command": " ".join(sys.argv)[:500]}
        _rewrite(handle, json.dumps(holder) + "\n")
        return lock

    def release(self, *, refused: bool = False) -> None:
        """Let the lock go. A session `refused` before it wrote anything leaves no trace: a folder it created
        that holds only the lock file is removed (with the missing parents it made), a lock file it created in
        an existing folder is removed, an empty folder it made inside (checkpoints/ for the preflight) is
        removed, and otherwise the lock file gets its last holder's line back."""
        if self._handle is None:
            return
        if refused:
            _remove_empty_folders([self.run_dir / name for name in self._new_names()])
            if self.created_folder and not [name for name in self._new_names() if name != LOCK_NAME]:
                (self.run_dir / LOCK_NAME).unlink(missing_ok=True)
                self._close()
                _remove_empty_folders([self.run_dir, *self.created_parents])
                return
            if self.created_file:
                # Unlinked while still held: a process that opened this file and takes the lock after us finds
                # the name gone (or another file under it) and starts over on the current one
                # (_open_and_lock).
                (self.run_dir / LOCK_NAME).unlink(missing_ok=True)
                self._put_times_back()
                self._close()
                return
            _rewrite(self._handle, self.previous_text)
            self._put_times_back()
        self._close()

    def _put_times_back(self) -> None:
        """The lock file's and the run folder's times as this session found them (a refused session wrote its
        holder line and took it back: the folder reads as untouched, bytes and times)."""
        if self.times_before is None:
            return
        folder_times, *lock_times = self.times_before
        try:
            if lock_times and not self.created_file:
                os.utime(self._handle.fileno(), ns=lock_times[0])
            os.utime(self.run_dir, ns=folder_times, follow_symlinks=False)
        except OSError:
            pass  # times are what a reader sees, not what a resume needs: the bytes are already back

    def _new_names(self) -> list[str]:
        try:
            return sorted(p.name for p in self.run_dir.iterdir() if p.name not in self.names_before)
        except OSError:
            return []

    def _close(self) -> None:
        handle, self._handle = self._handle, None
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        except OSError:
            pass
        handle.close()

    def __del__(self) -> None:  # a session object dropped without release (a notebook): let the lock go
        try:
            self._close() if self._handle is not None else None
        except Exception:
            pass
