"""Multiple-choice task files: the shape of HellaSwag, ARC and PIQA as local JSONL (torch-free).

A task file holds one example a line: `{"context": "...", "choices": ["...", "..."], "label": 0}`, the label
the index of the right choice. The model's answer is the choice it finds most likely after the context
(training/multiple_choice.py scores it), so a choice is written as it continues the context: with its leading
space where one belongs (" the cat sat"). Other fields of a line are kept out of the task's meaning but
stay in its identity.

A task is named by its file's stem and identified by the sha256 of the file's bytes: two figures measured on
the same sha256 were measured on the same examples, whatever the file was called or where it lay. The
examples are read in file order and never shuffled, so `limit` takes the same first examples everywhere (the
in-loop callback and `pilotrun evaluate` score the same ones).

A file that is missing, not UTF-8, has a line that is not such an object, or holds no example is refused with
one line naming the file and the line (`DataError`, exit 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pilotrun.common.errors import DataError
from pilotrun.common.files import sha256_of_file

TASK_SUFFIX = ".jsonl"


@dataclass(frozen=True)
class ChoiceExample:
    context: str
    choices: tuple[str, ...]
    label: int


@dataclass(frozen=True)
class ChoiceTask:
    """A task file read and checked: its name (the file stem), path, sha256 and examples in file order."""

    name: str
    path: str
    sha256: str
    examples: tuple[ChoiceExample, ...]

    def first(self, limit: int = 0) -> tuple[ChoiceExample, ...]:
        """The first `limit` examples (0: all of them)."""
        return self.examples[:limit] if limit > 0 else self.examples

    def identity(self, limit: int = 0) -> dict[str, Any]:
        """What an evaluation records of the task it measured: name, sha256 and the examples scored."""
        return {"task": self.name, "sha256": self.sha256, "examples": len(self.first(limit))}


def chance_accuracy(examples: tuple[ChoiceExample, ...]) -> float:
    """The accuracy of guessing uniformly: the mean over examples of 1 / its number of choices."""
    return sum(1.0 / len(e.choices) for e in examples) / len(examples) if examples else 0.0


# The longest context or choice an example may hold: 1 Mi characters, over 200 times a 4,096-token window of
# English (about 4 characters a token), far past anything a scored window reads. A 10 MB context took 1.9 GB
# to tokenize, a 100 MB one aborted the tokenizer (exit 134).
MAX_TEXT_CHARS = 1 << 20


def _example(value: Any, where: str) -> ChoiceExample:
    if not isinstance(value, dict):
        raise DataError(f"{where}: expected a JSON object with context, choices and label")
    context, choices, label = value.get("context"), value.get("choices"), value.get("label")
    if not isinstance(context, str):
        raise DataError(f"{where}: 'context' must be a string")
    if not (
        isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)
    ):
        raise DataError(f"{where}: 'choices' must be a list of at least two non-empty strings")
    if not (isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(choices)):
        raise DataError(f"{where}: 'label' must be an integer index into choices (0..{len(choices) - 1}), "
                        f"got {label!r}")
    longest = max(len(context), *map(len, choices))
    if longest > MAX_TEXT_CHARS:
        raise DataError(
            f"{where}: a text of {longest:,} characters; at most {MAX_TEXT_CHARS:,} (a model scores "
            "only the last window of tokens of an example, and the tokenizer needs gigabytes for "
            "tens of megabytes of text, or aborts)"
        )
    return ChoiceExample(context, tuple(choices), label)


def read_choice_task(path: str | Path) -> ChoiceTask:
    """Read and check a task file (module docstring); DataError naming the file and line on any problem."""
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"task file {path}: not found" if not path.exists() else f"task file {path}: not a file"
        )
    if path.suffix != TASK_SUFFIX:
        raise DataError(f"task file {path}: expected a {TASK_SUFFIX} file of multiple-choice examples")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"task file {path}: not UTF-8 (byte {exc.start})") from None
    except OSError as exc:
        raise DataError(f"task file {path}: cannot be read ({exc.strerror or exc})") from None
    examples = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"task file {path} line {number}"
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):
            raise DataError(f"{where}: not JSON") from None
        examples.append(_example(value, where))
    if not examples:
        raise DataError(f"task file {path}: holds no example")
    return ChoiceTask(path.stem, str(path), sha256_of_file(path), tuple(examples))


def read_choice_tasks(paths: list[str] | tuple[str, ...]) -> list[ChoiceTask]:
    """Every task file of a list, checked; two files with the same name (stem) are refused, since figures are
    recorded under the task's name."""
    tasks = [read_choice_task(p) for p in paths]
    names = [t.name for t in tasks]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DataError(f"task files share a name (their file stem): {', '.join(twice)}; rename one")
    return tasks
