"""Spike false alarms and catches on real runs, as BENCHMARKS.md's "Spike false alarms" section measures them.

    python -m benchmarks.spike_rates plant OUT COUNT GAP  # COUNT noise documents, GAP characters apart
    python -m benchmarks.spike_rates judge RUN ... [--spans OUT/spans.json]

`plant` writes OUT/data (bpe:4096, shuffle buffer 1: the documents in their order), the built-in corpus's
training documents with a 3,000-character noise document (random letters, digits and symbols, as the rollback
test's) after every GAP characters, and OUT/spans.json (each noise document's [first token, past its EOS]).
`judge` replays the trainer's detector (training/spikes/detector.py, the run's tokens per update) over each
run's per-update (loss, grad norm) (train.log_every=1, train.spike.policy=record: every update applied, so the
window is the trainer's) and prints, per floor of the gradient norm (`fixed`: MIN_SCALE_SHARE's 4x; `scaled`:
grad_norm_floor_share's, as the trainer now judges), spikes per 1,000 updates outside the planted documents
(and the 3 updates after each) and, with --spans, which planted documents an update reading them flagged.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from pilotrun.config import SpikeConfig
from pilotrun.training.spikes.detector import SpikeDetector

ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]<>#@$%^&*~|\\/"
AFTER = 3  # updates after a planted document still counted as its own (the model's answer to it)


def plant(out: Path, count: int, gap: int) -> list[list[int]]:
    import numpy as np

    from pilotrun.data.builtin_corpus import builtin_documents
    from pilotrun.data.prepare import prepare_corpus
    from pilotrun.data.reader import open_dataset
    from pilotrun.data.stream import split_of

    out.mkdir(parents=True, exist_ok=True)
    docs = [d for d in builtin_documents() if split_of(d, 0.01) == "train"]
    rng, texts, planted = random.Random(0), [], []
    for _ in range(count):
        chunk: list[str] = []
        while sum(map(len, chunk)) < gap:
            chunk.append(docs.pop(0))
        noise = ""
        while not noise or split_of(noise, 0.01) != "train":
            noise = "".join(rng.choice(ALPHABET) for _ in range(3000))
        texts += chunk
        planted.append(len(texts))
        texts.append(noise)
    with open(out / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in [*texts, *docs])
    prepare_corpus(out / "data", source=str(out / "corpus.jsonl"), tokenizer="bpe:4096", shuffle_buffer=1,
                   progress=False)
    dataset = open_dataset(out / "data")
    split = dataset.split("train")
    ends = np.flatnonzero(split.read(0, split.num_tokens) == dataset.eos_id)
    spans = [[int(ends[i - 1]) + 1, int(ends[i]) + 1] for i in planted]
    (out / "spans.json").write_text(json.dumps(spans) + "\n")
    return spans


def judge(run: Path, spans: list[list[int]], scaled: bool) -> tuple[int, int, list[bool]]:
    """(updates, false spikes, per planted document whether an update reading it was flagged)."""
    record = json.loads((run / "run.json").read_text())
    tokens = int(record["tokens_per_update"])
    detector = SpikeDetector(SpikeConfig(), tokens if scaled else None)
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    updates = [e for e in events if e["event"] == "train"]
    planted = [(first // tokens, (past - 2) // tokens) for first, past in spans]
    planted = [(f, last) for f, last in planted if last < len(updates)]  # documents the run read whole
    flagged = set()
    for e in updates:
        if detector.judge(e["loss"], e["grad_norm"])[0]:
            flagged.add(e["step"] - 1)  # the batch update `step` read (accumulation 1, nothing skipped)
        detector.pending = (e["loss"], e["grad_norm"])
        detector.after_update(e["step"], None)
    false = [b for b in flagged if not any(f <= b <= last + AFTER for f, last in planted)]
    return len(updates), len(false), [any(f <= b <= last for b in flagged) for f, last in planted]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spike_rates")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plant")
    p.add_argument("out", type=Path)
    p.add_argument("count", type=int)
    p.add_argument("gap", type=int)
    j = sub.add_parser("judge")
    j.add_argument("runs", nargs="+", type=Path)
    j.add_argument("--spans", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "plant":
        print(json.dumps(plant(args.out, args.count, args.gap)))
        return 0
    spans = json.loads(args.spans.read_text()) if args.spans is not None else []
    for run in args.runs:
        for floor in ("fixed", "scaled"):
            updates, false, caught = judge(run, spans, floor == "scaled")
            said = f"; planted caught {sum(caught)}/{len(caught)} {caught}" if spans else ""
            print(f"{run}: {floor} floor: {updates} updates, false spikes {1000 * false / updates:.1f} "
                  f"per 1,000{said}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
