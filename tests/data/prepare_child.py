"""`pilotrun prepare` in a child process that stops itself at a point the test names (no hook in production).

    python tests/data/prepare_child.py POINT N -- PREPARE_ARGS...

POINT (N counts calls from 1):
- `encode`: SIGKILL at the Nth tokenizer batch (inside a shard);
- `before-commit`: SIGKILL as the Nth progress commit starts (pending tokens may be half persisted);
- `after-commit`: SIGKILL just after the Nth progress commit (between shards);
- `manifest`: SIGKILL halfway through writing metadata.json;
- `sigint` / `sigterm` / `sighup`: send that signal to itself at the Nth tokenizer batch, then carry on;
- `chunk`: SIGKILL as the Nth encoded chunk reaches the shard writers (this process's side, so it also works
  with `--workers N` >= 2, whose encoding happens in worker processes).

With PREPARE_CHILD_PIDS=FILE in the environment, the pids of this process's children (the tokenizing workers)
are written to FILE, one a line, just before any SIGKILL, so that a test can check that none survives.
"""

from __future__ import annotations

import os
import signal
import sys


def _at_call(n: int, action):
    calls = {"n": 0}

    def hit() -> None:
        calls["n"] += 1
        if calls["n"] == n:
            action()

    return hit


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc: Linux)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def main(argv: list[str]) -> int:
    point, n, separator, *prepare_args = argv
    assert separator == "--"
    from pilotrun.commands.cli import main as cli_main
    from pilotrun.data import prepare
    from pilotrun.data import prepare_state as progress

    def kill() -> None:
        if os.environ.get("PREPARE_CHILD_PIDS"):
            with open(os.environ["PREPARE_CHILD_PIDS"], "w") as handle:
                handle.writelines(f"{pid}\n" for pid in children_of(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)

    if point in ("encode", "sigint", "sigterm", "sighup"):
        action = kill if point == "encode" else (lambda: os.kill(os.getpid(), getattr(signal, point.upper())))
        hit = _at_call(int(n), action)
        original_encode = prepare.encode_documents

        def encode(*args, **kwargs):
            hit()
            return original_encode(*args, **kwargs)

        prepare.encode_documents = encode
    elif point in ("before-commit", "after-commit"):
        hit = _at_call(int(n), kill)
        original_commit = progress.PartialFolder.commit

        def commit(self, *args, **kwargs):
            if point == "before-commit":
                hit()
            original_commit(self, *args, **kwargs)
            if point == "after-commit":
                hit()

        progress.PartialFolder.commit = commit
    elif point == "chunk":
        hit = _at_call(int(n), kill)
        original_encoded = prepare._encoded_in_order

        def encoded(*args, **kwargs):
            for item in original_encoded(*args, **kwargs):
                hit()
                yield item

        prepare._encoded_in_order = encoded
    elif point == "manifest":
        original_write = prepare._write_text

        def write(path, text):
            if path.endswith(prepare.METADATA_FILE):
                with open(path, "w", encoding="utf-8") as handle:
                    handle.write(text[: len(text) // 2])
                    handle.flush()
                    os.fsync(handle.fileno())
                kill()
            original_write(path, text)

        prepare._write_text = write
    else:
        raise SystemExit(f"unknown point {point}")
    return cli_main(["prepare", *prepare_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
