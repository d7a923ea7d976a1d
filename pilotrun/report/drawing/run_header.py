"""What a report is about: the run's identity, read from run.json, for the top of report.html.

A report is meant to be sent to someone who did not run it, so it first says what was run: the recipe (the
`--config` of the first session), the model size, the data (source, tokenizer, metadata_sha256), the code
(git commit, dirty or not), the software and hardware, and the sessions. Missing fields read "not recorded";
nothing is filled in from the machine that draws the report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

NOT_RECORDED = "not recorded"


def recipe_name(command: Any) -> str:
    """The `--config` value of a recorded command line (its file stem), else "not recorded"."""
    if not isinstance(command, list):
        return NOT_RECORDED
    for index, word in enumerate(command):
        if word == "--config" and index + 1 < len(command):
            return Path(str(command[index + 1])).stem
        if isinstance(word, str) and word.startswith("--config="):
            return Path(word.split("=", 1)[1]).stem
    if "--frozen" in command and command.index("--frozen") + 1 < len(command):
        return f"frozen candidate {command[command.index('--frozen') + 1]}"
    return NOT_RECORDED


def _describe_source(source: Any) -> str:
    if not isinstance(source, dict):
        return NOT_RECORDED
    kind = source.get("kind")
    if kind == "hub":
        return f"{source.get('dataset')}:{source.get('config')}@{str(source.get('revision'))[:12]} (hub)"
    if kind == "local":
        files = source.get("files") or []
        names = ", ".join(str(f.get("name")) for f in files[:3]) + (
            f" and {len(files) - 3} more" if len(files) > 3 else ""
        )
        return f"local files: {names}"
    return str(kind or NOT_RECORDED) + (f" ({source.get('documents'):,} documents)"
                                        if isinstance(source.get("documents"), int) else "")


def _describe_tokenizer(tokenizer: Any, vocab: Any) -> str:
    if not isinstance(tokenizer, dict):
        return NOT_RECORDED
    kind = tokenizer.get("kind")
    name = {"hub": f"{tokenizer.get('name')}@{str(tokenizer.get('revision'))[:12]} (hub)",
            "bpe": "byte-level BPE trained on the training split"}.get(str(kind), str(kind))
    return f"{name}, vocabulary {vocab:,}" if isinstance(vocab, int) else name


def run_identity(run: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows identifying a run, from its run.json."""
    sessions = run.get("sessions") or []
    first = sessions[0] if sessions else {}
    model, data = run.get("model") or {}, run.get("data") or {}
    total, active = model.get("parameters"), model.get("active_parameters")
    size = (
        f"{total:,} total, {active:,} active per token"
        if isinstance(total, int) and isinstance(active, int)
        else NOT_RECORDED
    )
    commits = []
    for s in sessions:
        git = s.get("git") or {}
        text = f"{str(git.get('commit') or 'unknown')[:12]}{' (dirty)' if git.get('dirty') else ''}"
        if text not in commits:
            commits.append(text)
    software = first.get("software") or {}
    hardware = first.get("hardware") or {}
    device = hardware.get("device_name") or hardware.get("device") or NOT_RECORDED
    world = hardware.get("world_size")
    precision = ((run.get("recipe") or {}).get("train") or {}).get("precision", NOT_RECORDED)
    return [
        ("recipe", f"{recipe_name(first.get('command'))} (precision {precision})"),
        ("model parameters", size),
        ("data source", _describe_source(data.get("source"))),
        ("tokenizer", _describe_tokenizer(data.get("tokenizer"), data.get("vocab_size"))),
        ("data metadata_sha256", str(data.get("metadata_sha256") or NOT_RECORDED)),
        ("git commit", ", ".join(commits) or NOT_RECORDED),
        (
            "software",
            f"torch {software.get('torch', '?')}, python {software.get('python', '?')}, "
            f"pilotrun {software.get('pilotrun', '?')}"
            if software
            else NOT_RECORDED,
        ),
        (
            "hardware",
            f"{device} ({hardware.get('device', '?')}), world size {world}" if hardware else NOT_RECORDED,
        ),
        (
            "sessions",
            f"{len(sessions)}: "
            + ", ".join(f"{s.get('session_id')} from step {s.get('start_step', 0)}" for s in sessions)
            if sessions
            else NOT_RECORDED,
        ),
    ]
