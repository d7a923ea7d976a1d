"""Durable file primitives shared by every writer: data manifests, run records, checkpoints, reports.

One place for the things crash safety and identity rest on: a file's sha256 (how damage is found), the one
canonical JSON of the project (what every identity hash is taken over: a data manifest's metadata_sha256,
run.json's digests, a frozen lock's sha256, the recipe all ranks compare), an atomic text write (temp file,
fsync, rename: a crash leaves the old file or the new one, never half of either), and an fsync of a folder (so
that a rename inside it survives a power loss).

And confinement: pilotrun writes only inside the folders it was given, never through a symbolic link. A link
where pilotrun writes (RUN/report, RUN/run.lock, a plot, a temp file's name) could point at a user's file
outside the run, which a write would truncate or replace; `refuse_link` and `plain_folder` refuse it by name
before anything is written, and `open_for_write` opens with O_NOFOLLOW so that a link planted between the
check and the open is refused by the kernel. The folder a user names (--run-dir, --out) may itself be a link
(their choice of where the run lives); what pilotrun creates inside it never is.

Every output is written as temp + rename, the temp named `.NAME.tmp-PID` beside its target: removed on any
failure (KeyboardInterrupt and a SIGTERM turned into SystemExit included); what a SIGKILL leaves is found by
`stale_temps` (the PID in the name is no process alive) and removed by the next writer of that folder.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import IO, Any

from pilotrun.common.errors import PilotrunError

HASH_CHUNK_BYTES = 8 << 20


def sha256_of_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8 (not ASCII escapes), and no NaN or infinity (JSON has none; an
    identity that held one could not be recomputed by another reader): the same value always gives the same
    bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )


def canonical_sha256(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def fsync_directory(path: str | Path) -> None:
    """Make a rename or a new file inside `path` durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening a folder; the rename itself is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class LinkRefused(PilotrunError):
    """A symbolic link where pilotrun would write: refused before anything is written (exit 2)."""


TEMP_PATTERN = re.compile(r"^\.(?P<name>.+)\.(?:hf\.)?tmp-(?P<pid>\d+)$")


def refuse_link(path: str | Path) -> None:
    """Raise LinkRefused naming `path` when it is a symbolic link (a dangling one included)."""
    if os.path.islink(path):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise LinkRefused(
            f"{path} is a symbolic link (to {target}); refused: pilotrun never writes through a "
            "link (remove it, or choose another folder)"
        )


def refuse_wrong_kind(path: str | Path, kind: str, what: str = "") -> None:
    """Refuse `path` by name when it is there as the other kind than `kind` ("file" or "folder"): "is a file,
    not a folder" or "is a folder, not a file", never "does not exist" (the user named something that is
    there, of the wrong kind) and never a traceback; so is a path whose parent is a file. A missing path
    passes: the caller knows what a missing one means (an output to make, an input to name). `what`: the
    argument, e.g. "--data", put before the path."""
    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    if kind == "folder" and path.exists() and not path.is_dir():
        raise PilotrunError(f"{label} is a file, not a folder")
    if kind == "file" and path.is_dir():
        raise PilotrunError(f"{label} is a folder, not a file")
    parent = path.parent
    while not os.path.lexists(path) and parent != path:
        if parent.exists() and not parent.is_dir():  # ENOTDIR under it: say which part is the file
            raise PilotrunError(f"{label}: {parent} is a file, not a folder")
        path, parent = parent, parent.parent


def plain_folder(path: str | Path, *, create: bool = True) -> Path:
    """`path` as a folder pilotrun may write into: not a link, not a file ("is a file, not a folder"), created
    (with its parents) when missing and `create`. Returns it as a Path."""
    path = Path(path)
    refuse_link(path)
    if path.exists() and not path.is_dir():
        raise PilotrunError(f"{path} is a file, not a folder; refused (pilotrun writes a folder there)")
    if create:
        path.mkdir(parents=True, exist_ok=True)
        refuse_link(path)  # made a link between the check and the mkdir: still refused before any write
    return path


def open_for_write(path: str | Path, mode: str = "w", *, exclusive: bool = False) -> IO[Any]:
    """Open `path` for writing ("w", "wb", "a", "ab") without following a symbolic link at it: a link there
    is refused by name (O_NOFOLLOW: also one planted after any earlier check). `exclusive`: the file must not
    exist yet (a temp file's name)."""
    refuse_link(path)
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    flags |= os.O_APPEND if mode.startswith("a") else (os.O_EXCL if exclusive else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            refuse_link(path)
        raise
    try:
        return os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8")
    except BaseException:
        os.close(fd)
        raise


def temp_path(path: str | Path) -> Path:
    """The temp name an atomic write of `path` uses: `.NAME.tmp-PID` beside it (found by `stale_temps`)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Temp file in the same folder (O_EXCL, O_NOFOLLOW), fsync, rename over the target, fsync the folder.
    A link at the target or as its folder is refused before anything is written; the temp file is removed on
    any failure (a full disk, an interrupt)."""
    path = Path(path)
    refuse_link(path.parent)
    refuse_link(path)
    tmp = temp_path(path)
    try:
        with open_for_write(tmp, "wb", exclusive=True) as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            if not os.path.islink(tmp):
                os.unlink(tmp)
        raise
    fsync_directory(path.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    """`write_bytes_atomic` of the UTF-8 text."""
    write_bytes_atomic(path, text.encode("utf-8"))


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def stale_temps(folder: str | Path, name: str | None = None) -> list[Path]:
    """Temp files and folders (`.NAME.tmp-PID`, `.NAME.hf.tmp-PID`) in `folder` whose writer is gone: what a
    SIGKILL or a power loss left. A temp of a live process (another writer, this one) is not listed. `name`:
    only the temps of that one output (in a user's folder, where other files are not pilotrun's)."""
    folder = Path(folder)
    if not folder.is_dir() or folder.is_symlink():
        return []
    found = []
    for child in folder.iterdir():
        match = TEMP_PATTERN.match(child.name)
        if not match or (name is not None and match.group("name") != name):
            continue
        if int(match.group("pid")) != os.getpid() and not pid_alive(int(match.group("pid"))):
            found.append(child)
    return sorted(found)


def remove_stale_temps(folder: str | Path, name: str | None = None) -> list[str]:
    """Remove `stale_temps(folder, name)`; returns one line per removal, naming it (for the command to
    print)."""
    lines = []
    for path in stale_temps(folder, name):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
        lines.append(f"removed {path}: a temp file an interrupted pilotrun left (its process is gone)")
    return lines


def replaced_path(path: str | Path) -> Path:
    """Where `swap_in_folder` keeps the old copy of `path` between its two renames: `.NAME.replaced-PID`."""
    path = Path(path)
    return path.with_name(f".{path.name}.replaced-{os.getpid()}")


def swap_in_folder(temp: str | Path, final: str | Path) -> None:
    """Put the finished folder `temp` in place of `final` (new, or an older copy): the older copy is renamed
    aside first, so a reader sees the old folder whole or the new one whole; killed between the two renames,
    the old copy is put back by `recover_folder` on the next write."""
    temp, final = Path(temp), Path(final)
    refuse_link(final)
    old = None
    if final.exists():
        old = replaced_path(final)
        os.rename(final, old)
    try:
        os.rename(temp, final)
    except BaseException:
        if old is not None:
            os.rename(old, final)
        raise
    fsync_directory(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def recover_folder(final: str | Path) -> list[str]:
    """What a killed writer of the folder `final` left beside it, cleaned: stale temps of it removed, and an
    older copy moved aside by `swap_in_folder` put back when `final` is missing (else removed). One line
    each."""
    final = Path(final)
    lines = remove_stale_temps(final.parent, final.name)
    pattern = re.compile(rf"^\.{re.escape(final.name)}\.replaced-(\d+)$")
    if not final.parent.is_dir():
        return lines
    for child in sorted(final.parent.iterdir()):
        match = pattern.match(child.name)
        if not match or child.is_symlink() or pid_alive(int(match.group(1))):
            continue
        if not os.path.lexists(final):
            os.rename(child, final)
            lines.append(f"restored {final} from {child.name}: a write replacing it was interrupted")
        else:
            shutil.rmtree(child, ignore_errors=True)
            lines.append(f"removed {child}: the older copy an interrupted write of {final.name} left")
    return lines


def not_regular(path: str | Path) -> str | None:
    """What `path` is when it exists but is neither a regular file nor a folder ("a character device", "a FIFO
    (named pipe)", ...), else None: such a path exists, so "not found" would be wrong, and reading it may
    never end (/dev/zero) or block (a FIFO with no writer)."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return f"{name}, not a regular file"
    return None
