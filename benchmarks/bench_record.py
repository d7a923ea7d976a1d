"""The hash chain's cost per train event, against a CPU update of the stability recipe.

Every metrics.jsonl line carries a sha256 chaining it to the line before (pilotrun/run/record.py), so each
event costs one more hash of its text than a plain JSON line. The events timed are real: the train events of a
short run of the stability recipe (its model, batch and MoE diagnostics, so each line is as long as a
pilot's), written again through MetricsWriter (the chained line) and through the same dumps + write + flush
without the chain, alternating event by event into two files on the same disk. The difference of the medians
is the chain's cost per event; the update it is compared with is the same run's training-only seconds per
update (its own windows). Both are CPU time of this thread (`time.thread_time`), which does not count the time
the thread waited for a core on a shared machine. Target: the chain's cost per train event under 1% of an
update.
"""

from __future__ import annotations

import io
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "configs" / "stability.yaml"
UPDATES = 12
REPEATS = 400
TARGET = 0.01


def _real_train_events(data_dir: Path, run_dir: Path) -> tuple[list[dict], float]:
    from pilotrun.config import load_run_config
    from pilotrun.run.record import read_metrics_strict
    from pilotrun.training.timing import TimeAccount
    from pilotrun.training.trainer import Trainer

    config = load_run_config(
        RECIPE,
        [
            f"train.max_steps={UPDATES}",
            "train.eval.every=0",
            "train.checkpoint.every=0",
            "train.log.every=2",
            "train.device=cpu",
            "train.num_threads=1",
        ],
    )
    trainer = Trainer(config, data_dir, run_dir, progress=False, out=io.StringIO())
    trainer.account = TimeAccount(clock=time.thread_time)
    result = trainer.run()
    if result.reason != "completed":
        raise RuntimeError(f"benchmark run did not complete: {result}")
    events = [e for e in read_metrics_strict(run_dir) if e["event"] == "train"]
    windows = [e["window"] for e in events][1:]  # the first window holds the warm-up
    per_update = sum(w["train_seconds"] for w in windows) / sum(w["updates_applied"] for w in windows)
    cleaned = [{k: v for k, v in e.items() if not k.startswith("_") and k != "chain"} for e in events]
    return cleaned, per_update


def run() -> str:
    from pilotrun.data.prepare import prepare_corpus
    from pilotrun.run.record import COUNTER_KEYS, Counters, dumps_line
    from pilotrun.run.writer import MetricsWriter

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data_dir = work / "data"
        prepare_corpus(data_dir, source="builtin", tokenizer="bpe:4096", progress=False)
        events, update_seconds = _real_train_events(data_dir, work / "run")
        chained = MetricsWriter(work / "chained", "bench", run_id="bench")
        plain = open(work / "plain.jsonl", "a", encoding="utf-8")
        line_bytes = [len(dumps_line(e)) for e in events]
        chained_times, plain_times = [], []
        for repeat in range(REPEATS):
            event = events[repeat % len(events)]
            fields = {
                k: v for k, v in event.items() if k not in ("event", "time", "session_id", *COUNTER_KEYS)
            }
            counters = Counters.of(event)
            order = (0, 1) if repeat % 2 == 0 else (1, 0)
            for side in order:
                started = time.thread_time()
                if side == 0:
                    chained.log("train", counters, **fields)
                else:
                    record = {
                        "event": "train",
                        "time": time.time(),
                        "session_id": "bench",
                        **counters.as_dict(),
                        **fields,
                    }
                    plain.write(dumps_line(record) + "\n")
                    plain.flush()
                (chained_times if side == 0 else plain_times).append(time.thread_time() - started)
        chained.close()
        plain.close()

    chained_us, plain_us = statistics.median(chained_times) * 1e6, statistics.median(plain_times) * 1e6
    cost_us = chained_us - plain_us
    share = cost_us * 1e-6 / update_seconds
    met = "met" if share < TARGET else "NOT met"
    return "\n".join(
        [
            "## Run record: the hash chain's cost per train event",
            "",
            f"Events: the {len(events)} train events of a {UPDATES}-update run of configs/stability.yaml "
            "(log_every 2; "
            f"{min(line_bytes):,}-{max(line_bytes):,} bytes a line), each written {REPEATS // len(events)} "
            "times "
            "through `MetricsWriter.log` (chained) and through the same JSON line without the chain, "
            "alternating; "
            "CPU time of this thread, medians.",
            "",
            "| measurement | per train event |",
            "|---|---:|",
            f"| JSON line, write + flush, no chain | {plain_us:.1f} µs |",
            f"| `MetricsWriter.log` (the same + sha256 chain) | {chained_us:.1f} µs |",
            f"| the chain's cost (difference) | {cost_us:.1f} µs |",
            f"| one CPU update of the stability recipe (the same run's training-only seconds) | "
            f"{update_seconds * 1e3:.1f} ms |",
            "",
            f"Target: the chain's cost per train event under {TARGET:.0%} of an update: **{met}** "
            f"({share:.4%}). A "
            "train event is written once per log window (every 5 to 10 updates in the recipes), so per "
            "update the "
            "share is smaller still.",
            "",
            "Command: `python -m benchmarks.run_all bench_record`",
            "",
        ]
    )


if __name__ == "__main__":
    print(run())
