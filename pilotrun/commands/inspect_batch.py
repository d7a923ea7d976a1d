"""Spike forensics: which tokens did update N read? `pilotrun inspect-batch R --step N`.

The answer is reconstructed, not stored: every attempted update reads exactly `gradient_accumulation_steps`
global microbatches in order, and the loader's cursor is global, so attempt k (1-based) read the next A
microbatches after attempt k-1's, stepping over every `train.skip_data` range and every range a spike's
rollback skipped (run.json's skip_data); without skips that is (k-1)*A .. k*A-1. Applied update N is the N-th
attempt that was not skipped: the skipped attempts are the `overflow` events and the spikes skipped by policy
(each records `updates_attempted` after the skip), in the history a rollback kept. A resumed session repeats,
bit for bit, what a crashed one did after its checkpoint, so duplicated overflow events of rolled-back work
name the same attempts and are counted once.

The loader's `describe_batch(batch_index)` then names, per row, the shard file, offset and length it read (for
a data mixture also the row's source and its row and pass in that source: data/mixed_reader.py), and the
tokenizer saved in the data folder decodes them, with no network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pilotrun.common.errors import ConfigError, DataError
from pilotrun.common.parsing import one_line
from pilotrun.report.record_check.spike_history import split_rollbacks
from pilotrun.run.record import RUN_JSON, read_metrics_strict, read_run_json
from pilotrun.training.spikes.detector import skip_ahead, upcoming_batches

GEOMETRY_KEYS = ("train.batch_size", "train.seq_len", "train.gradient_accumulation_steps", "train.data_mode")


def attempt_for_step(step: int, skipped_attempts: set[int]) -> int:
    """The 1-based attempt number whose applied update made `step` (step >= 1)."""
    if step < 1:
        raise ConfigError(f"--step must be >= 1 (update N is the one that made step N), got {step}")
    applied = 0
    attempt = 0
    while applied < step:
        attempt += 1
        if attempt not in skipped_attempts:
            applied += 1
    return attempt


def microbatches_for_step(run_dir: str | Path, step: int) -> tuple[list[int], dict[str, Any]]:
    """(global microbatch indices read by applied update `step`, run.json)."""
    run_dir = Path(run_dir)
    if not (run_dir / RUN_JSON).is_file():
        raise ConfigError(f"{run_dir / RUN_JSON} not found: is {run_dir} a run folder?")
    run = read_run_json(run_dir)
    # The skipped attempts come from the log: an edited log would name other batches, so its chain must hold.
    events = read_metrics_strict(run_dir, run_id=str(run.get("run_id")))
    reached = max((e["step"] for e in events), default=0)
    if step > reached:
        raise ConfigError(f"--step {step}: the run record of {run_dir} reaches step {reached} only")
    changed = [c["key"] for c in run.get("allowed_changes", []) if c.get("key") in GEOMETRY_KEYS
               or str(c.get("key")).startswith("data.mixture.")]
    if changed:
        raise ConfigError(
            f"{run_dir}: batch geometry changed during the run ({', '.join(changed)}: a batch "
            "geometry or mixture key); the cursor arithmetic of inspect-batch does not cover that"
        )
    kept, _ = split_rollbacks(events)  # a rollback's undone attempts are numbered again after it
    skipped = {int(e["updates_attempted"]) for e in kept
               if e["event"] == "overflow" or (e["event"] == "spike" and e.get("action") == "skipped")}
    accumulation = int(run["recipe"]["train"]["gradient_accumulation_steps"])
    return attempt_batches(attempt_for_step(step, skipped), accumulation, skip_ranges_of(run)), run


def skip_ranges_of(run: dict[str, Any]) -> list[list[int]]:
    """Every [first_batch, batches] range the loader stepped over: run.json's skip_data (the recipe's and each
    rollback's), or the recipe's train.skip_data in a record from before skip_data was written."""
    section = run.get("skip_data")
    if isinstance(section, list):
        return [[int(r["first_batch"]), int(r["batches"])] for r in section]
    return [[int(first), int(count)] for first, count in run["recipe"]["train"].get("skip_data") or []]


def attempt_batches(attempt: int, accumulation: int, ranges: list[list[int]]) -> list[int]:
    """The global microbatches attempt `attempt` read, the loader stepping over `ranges` as it did. Every
    range is applied from the first attempt: a rollback's lies ahead of the cursor of the checkpoint it
    restored, so the attempts before it read the same batches with or without it."""
    cursor, batches = 0, []
    for _ in range(attempt):
        batches = upcoming_batches(skip_ahead(cursor, ranges), accumulation, ranges)
        cursor = batches[-1] + 1
    return batches


def inspect_batch(run_dir: str | Path, step: int, max_chars: int = 400) -> str:
    try:
        return _inspect_batch(run_dir, step, max_chars)
    # a field of run.json / an event missing or mistyped
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise DataError(
            f"{run_dir}: the run record is damaged (run.json or metrics.jsonl: missing or malformed "
            f"{type(exc).__name__} {' '.join(str(exc).split())[:120]}); `pilotrun summarize` lists every "
            "problem"
        ) from None


def _inspect_batch(run_dir: str | Path, step: int, max_chars: int) -> str:
    from pilotrun.data.mixed_reader import MixedDataset, MixedLoader, open_data
    from pilotrun.data.reader import BatchLoader

    indices, run = microbatches_for_step(run_dir, step)
    data_dir = Path(run["data"]["dir"])
    dataset = open_data(data_dir)
    if dataset.metadata_sha256 != run["data"]["metadata_sha256"]:
        raise DataError(f"{data_dir}: metadata_sha256 {dataset.metadata_sha256[:12]} differs from the run's "
                        f"{run['data']['metadata_sha256'][:12]}: not the data this run read")
    t = run["recipe"]["train"]
    world_size = int(run["sessions"][-1]["hardware"]["world_size"])
    if isinstance(dataset, MixedDataset):
        loader: BatchLoader | MixedLoader = MixedLoader(dataset, int(t["batch_size"]), int(t["seq_len"]),
                                                        mode=t["data_mode"], rank=0, world_size=world_size)
        splits = dataset.splits("train")
    else:
        loader = BatchLoader(
            dataset.split("train"),
            int(t["batch_size"]),
            int(t["seq_len"]),
            mode=t["data_mode"],
            rank=0,
            world_size=world_size,
        )
        splits = [dataset.split("train")]
    tokenizer = dataset.load_tokenizer()
    lines = [f"run {run.get('run_id')}: update {step} read {len(indices)} microbatch(es) {indices} "
             f"(data {data_dir}, mode {t['data_mode']}, {t['batch_size']} x {t['seq_len']} per rank, "
             f"world size {world_size})"]
    for batch_index in indices:
        for row in loader.describe_batch(batch_index):
            pieces = row["pieces"]
            tokens = splits[row.get("source_index", 0)].read(int(row["start"]), int(row["length"]))
            where = ", ".join(f"{_piece(p)[0]}[{_piece(p)[1]}:{_piece(p)[1] + _piece(p)[2]}]" for p in pieces)
            text = tokenizer.decode([int(x) for x in tokens])
            shown = text if len(text) <= max_chars else text[:max_chars] + " [...]"
            source = (f" source {row['source']} row {row['source_row']} (pass {row['epoch']})"
                      if "source" in row else "")
            lines.append("")
            lines.append(
                f"microbatch {batch_index} rank {row['rank']} row {row['row']}{source}: {len(tokens)} tokens "
                f"from {where}"
            )
            lines.append(repr(shown))
    # A mixture source's name, a shard's file name and the data folder come from files a user may not have
    # written: quoted one line each, never as commands to the terminal.
    return "\n".join(one_line(line) for line in lines)


def _piece(piece: Any) -> tuple[str, int, int]:
    if isinstance(piece, dict):
        return str(piece["shard_file"]), int(piece["offset"]), int(piece["length"])
    shard_file, offset, length = piece
    return str(shard_file), int(offset), int(length)
