"""One bounded reader for every JSON and YAML text pilotrun reads: a hostile file is one line and exit 2.

Run folders, locks, data manifests and recipes come from disk, and a file on disk may be damaged, cut or
crafted. Python's parsers turn such input into exceptions that are not PilotrunError: a JSON nested 200,000
brackets deep raises RecursionError, an integer of 10,000 digits ValueError, a YAML "billion laughs" (aliases
of aliases) expands into gigabytes and MemoryError, bytes that are not UTF-8 UnicodeDecodeError. Here each
becomes the caller's PilotrunError with one line that names the file and the problem, and never echoes more
than a short prefix of the bad value:

- size: a file is read up to `max_bytes` (a run.json or a lock is kilobytes; 64 MiB is far past any of them);
- depth: nesting past MAX_DEPTH levels is refused (pilotrun's own files nest fewer than ten);
- YAML aliases (`*name`) are refused outright: no recipe needs them, and they are how a small file expands;
- integers: Python's own limit on digits in int() (4,300) turns into the same one line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from pilotrun.common.errors import ConfigError, PilotrunError

MAX_TEXT_BYTES = 64 << 20
MAX_DEPTH = 100
SHOWN_CHARS = 60


# What a terminal would act on rather than show: C0 controls but newline and tab (an escape starts a sequence
# that moves the cursor, retitles the window or rewrites what was printed), DEL, C1 controls and the Unicode
# marks that reorder text. A recorded field (a session id, a message) is data, never a command to the
# terminal.
_TERMINAL_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: str) -> str:
    """`text` with every character a terminal would act on written as its Python escape (ESC as \\x1b)."""
    return _TERMINAL_UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def one_line(text: str) -> str:
    """`terminal_safe(text)` with its newlines and tabs escaped too: for a line that quotes the record (an
    alert, a note), where a newline in a forged field would start a line of its own making, a fake "healthy"
    one."""
    return terminal_safe(text).replace("\n", "\\n").replace("\t", "\\t")


def printable_lines(lines: list[str]) -> str:
    """Lines a report builds from recorded fields, joined for the terminal: each one `one_line`, so that a
    field holding a newline (a forged session id, a source's name) cannot start a line of its own making, nor
    an escape sequence act on the terminal; the report's own line breaks are the joins."""
    return "\n".join(one_line(line) for line in lines)


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """A value as it may appear in a refusal: its first `limit` characters and the count of the rest."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit:,} more characters)"


def nesting_depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """The depth of lists and dicts in a parsed value, counted without recursion and stopped past `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _refuse_deep(value: Any, where: str, error: type[PilotrunError]) -> Any:
    if nesting_depth(value) > MAX_DEPTH:
        raise error(f"{where}: nested deeper than {MAX_DEPTH} levels; refused")
    return value


def parse_json_text(text: str, where: str, error: type[PilotrunError] = PilotrunError) -> Any:
    """json.loads with every failure as `error`: bad syntax, too deep, an integer too long."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise error(f"{where}: nested deeper than the JSON parser can follow; refused") from None
    except ValueError as exc:  # json.JSONDecodeError, and int()'s limit on digits
        raise error(f"{where}: not valid JSON ({shown(' '.join(str(exc).split()), 120)})") from None
    return _refuse_deep(value, where, error)


def read_text_bounded(path: str | Path, where: str | None = None, error: type[PilotrunError] = PilotrunError,
                      max_bytes: int = MAX_TEXT_BYTES) -> str:
    """A UTF-8 text file of at most `max_bytes`, or `error` naming it (missing, a folder, too big, not
    UTF-8)."""
    path = Path(path)
    where = where or str(path)
    try:
        with open(path, "rb") as handle:
            raw = handle.read(max_bytes + 1)
    except IsADirectoryError:
        raise error(f"{where}: is a folder, not a file") from None
    except FileNotFoundError:
        raise error(f"{where}: not found") from None
    except OSError as exc:
        raise error(f"{where}: cannot be read ({exc.strerror or exc})") from None
    if len(raw) > max_bytes:
        raise error(f"{where}: larger than {max_bytes:,} bytes; refused")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None


def read_json_file(path: str | Path, where: str | None = None, error: type[PilotrunError] = PilotrunError,
                   max_bytes: int = MAX_TEXT_BYTES) -> Any:
    """A JSON file read with both bounds: its size, then what parse_json_text refuses."""
    where = where or str(path)
    return parse_json_text(read_text_bounded(path, where, error, max_bytes), where, error)


class BoundedSafeLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases and with a depth limit: a recipe is plain mappings and lists."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not accepted in a pilotrun file", event.start_mark
            )
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def yaml_error_line(exc: yaml.YAMLError) -> str:
    """PyYAML's message spans several lines (context, a quoted excerpt, a caret); one line: problem and
    place."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return shown(" ".join(str(exc).split()), 120)


def parse_yaml_text(text: str, where: str, error: type[PilotrunError] = ConfigError) -> Any:
    """YAML through BoundedSafeLoader, every failure as `error` with one line."""
    try:
        return yaml.load(text, Loader=BoundedSafeLoader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        raise error(f"{where}: not valid YAML: {yaml_error_line(exc)}") from None
    except RecursionError:
        raise error(f"{where}: nested deeper than the YAML parser can follow; refused") from None
    except ValueError as exc:  # int()'s limit on digits, inside the resolver
        raise error(f"{where}: a value cannot be read ({shown(' '.join(str(exc).split()), 120)})") from None
